"""The kernel series as reviewers get them: one directory per feature, each
applying on the series it names, messages that describe the code they carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from freepage_lab import kernel, patchqueue, paths, prefixbuild
from freepage_lab.shell import LabError, Shell

SERIES = ("page-reporting", "never-zero-twice", "prezero")

# names of code that earlier versions had and the series no longer contains:
# no commit message or cover letter may describe them as present
REMOVED_NAMES = (
    "assume_reported_zero",      # virtio_balloon override, replaced by bit 6
    "reports_zeroed",            # old page_reporting_dev_info field
    "page_reporting.flush",      # module parameter, now a sysfs attribute
    "host_zeroes_pages",         # the RFC's module parameter
    "__GFP_PREZEROED",           # the RFC's GFP flag
    "QEMU 7.2",                  # old baseline table
)


def message(patch: Path) -> str:
    """A format-patch file up to its diff (the commit message or cover text)."""
    text = patch.read_text(errors="replace")
    return text.split("\n---\n", 1)[0] if not patch.name.startswith("0000-") else text


def added_and_removed(patch: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Per file of a patch: the lines it adds and the lines it removes."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in patch.read_text(errors="replace").splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
            if current:
                out.setdefault(current, ([], []))
        elif current and line.startswith("+") and not line.startswith("+++"):
            out[current][0].append(line[1:])
        elif current and line.startswith("-") and not line.startswith("---"):
            out[current][1].append(line[1:])
    return out


@pytest.mark.parametrize("name", SERIES)
def test_each_series_has_its_directory_series_file_and_cover_letter(name):
    queue = kernel.QUEUES[name]
    assert queue.patch_dir == paths.KERNEL_DIR / name / "patches"
    series = kernel.Series.load(queue.patch_dir)
    assert series.names, f"{name}: empty series"
    cover = (queue.patch_dir / patchqueue.COVER).read_text()
    assert "base-commit: " in cover
    # a series on top of others names each of their patches by patch id
    prereqs = sum(len(kernel.Series.load(kernel.QUEUES[r].patch_dir).names)
                  for r in queue.requires)
    assert cover.count("prerequisite-patch-id: ") == prereqs
    for section in ("Changes since the previous version", "Numbers", "Open questions", "Cc: "):
        assert section in cover, f"{name}: cover letter has no {section!r}"


def test_the_x86_and_uml_kernel_applies_the_three_series_in_order():
    stacked = kernel.Series.stacked(kernel.queue_for("x86_64"))
    dirs = [n.split("/")[0] for n in stacked.names]
    assert dirs == sorted(dirs, key=SERIES.index)
    assert set(dirs) == set(SERIES)
    assert all(f.is_file() for f in stacked.files)


@pytest.mark.parametrize("name", SERIES)
def test_messages_name_no_removed_code(name):
    for patch in sorted(kernel.QUEUES[name].patch_dir.glob("*.patch")):
        text = message(patch)
        for old in REMOVED_NAMES:
            assert old not in text, f"{patch.name} describes {old!r}, which the series lacks"


def test_removed_names_are_really_gone_from_the_code():
    """The list above only makes sense for names no patch adds any more."""
    for name in SERIES:
        for patch in kernel.QUEUES[name].patch_dir.glob("0[0-9][0-9][1-9]-*.patch"):
            for lines, _ in added_and_removed(patch).values():
                for old in REMOVED_NAMES[:5]:
                    assert not any(old in ln for ln in lines), (patch.name, old)


def is_code(line: str) -> bool:
    """A line of C that is not blank and not part of a comment."""
    text = line.strip()
    return bool(text) and not text.startswith(("/*", "*", "//"))


def test_prezero_series_does_not_repair_its_own_patches():
    """No patch removes a line of code that an earlier patch of the
    pre-zeroing series added (comments may grow with the code they
    describe), except where the non-temporal store patch replaces the
    way a page is cleared, listed here."""
    replaces = {"mm/page_prezero.c": {"\t\tclear_highpage(nth_page(page, i));"}}
    added: dict[str, set[str]] = {}
    for patch in kernel.Series.load(kernel.QUEUES["prezero"].patch_dir).files:
        for path, (plus, minus) in added_and_removed(patch).items():
            if not path.endswith((".c", ".h")):
                continue
            redone = {ln for ln in minus if is_code(ln) and ln in added.get(path, set())}
            redone -= replaces.get(path, set())
            assert not redone, f"{patch.name} rewrites code an earlier patch added: {redone}"
            added.setdefault(path, set()).update(plus)


@pytest.mark.parametrize("name", SERIES)
def test_no_series_puts_assembly_in_mm(name):
    """Instructions are an architecture's business: mm/ calls a hook
    (clear_page_nocache() for non-temporal clearing) that x86 implements
    and every other architecture falls back from to clear_page()."""
    for patch in kernel.Series.load(kernel.QUEUES[name].patch_dir).files:
        for path, (plus, _) in added_and_removed(patch).items():
            if not path.startswith("mm/"):
                continue
            asm = [ln for ln in plus if re.search(r"\basm\b|__asm__|\bmovnti\b", ln)]
            assert not asm, f"{patch.name} adds assembly to {path}: {asm}"


def test_build_each_applies_every_patch_in_order_and_builds_each_prefix(capsys):
    res = prefixbuild.build_each(Shell(dry_run=True), kernel.queue_for("x86_64"),
                                 ("um", "x86_64"), with_kunit=True)
    assert res.status == "ok", res.detail
    cap = capsys.readouterr()
    out = cap.out + cap.err
    applied = re.findall(r"patch -p1 .* -i (\S+)", out)
    # UML's platform support first, as in every UML build
    platform = [str(f) for f in kernel.with_platform("um", kernel.Series.empty()).files]
    expected = [str(f) for f in kernel.Series.stacked(kernel.queue_for("x86_64")).files]
    assert platform and applied == platform + expected
    # one incremental build per patch and arch, KUnit where a patch changes a suite
    assert len(re.findall(r"ARCH=um .*-j\d", out)) == len(expected)
    assert len(re.findall(r"ARCH=x86_64 .*-j\d", out)) == len(expected)
    kunit_patches = [f for f in kernel.Series.stacked(kernel.queue_for("x86_64")).files
                     if prefixbuild.touches_kunit(f)]
    assert kunit_patches, "no patch adds a KUnit suite"
    assert out.count("kunit_shutdown=halt") >= len(kunit_patches)


def test_build_each_from_a_patch_applies_the_ones_before_unbuilt(capsys):
    """A run resumed at a patch applies every earlier patch, so the tree
    is the same prefix, but builds only from that patch on."""
    queue = kernel.queue_for("x86_64")
    todo = prefixbuild.steps(queue)
    res = prefixbuild.build_each(Shell(dry_run=True), queue, ("um",), with_kunit=False,
                                 start="prezero/0004")
    assert res.status == "ok", res.detail
    out = "".join(capsys.readouterr())
    first = next(i for i, s in enumerate(todo) if s.label.startswith("prezero/0004"))
    applied = [a for a in re.findall(r"patch -p1 .* -i (\S+)", out)
               if a in {str(s.patch) for s in todo}]
    assert applied == [str(s.patch) for s in todo]
    assert len(re.findall(r"ARCH=um .*-j\d", out)) == len(todo) - first
    assert out.count("olddefconfig") == len(todo) - first
    assert f"[{first + 1}/{len(todo)}] prezero/0004" in out and f"[{first}/" not in out
    assert f"patches {first + 1}-{len(todo)} of {len(todo)}" in res.detail


@pytest.mark.parametrize("start", ["0", "999", "/0001-", "no-such-patch"])
def test_build_each_from_names_one_patch_or_says_why_not(start):
    with pytest.raises(LabError, match=r"--from"):
        prefixbuild.build_each(Shell(dry_run=True), kernel.queue_for("x86_64"), ("um",),
                               start=start)


def test_build_each_waits_for_another_build_each_before_it_clears_the_tree(tmp_path, monkeypatch):
    """Worktrees share one prefix tree in the cache: a second build-each
    must not delete it while the first one's compiler is using it."""
    import fcntl
    import threading

    monkeypatch.setattr(paths, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(kernel, "base_tree", lambda shell: tmp_path / "base")
    monkeypatch.setattr(kernel, "base_version", lambda shell: "6.12-test")
    tree = tmp_path / "prefix" / "6.12-test"
    (tree / "um-prefix-build").mkdir(parents=True)
    cleared = threading.Event()
    monkeypatch.setattr(prefixbuild.shutil, "rmtree", lambda path: cleared.set())

    class StopAtCopy(Shell):
        def run(self, argv, **kw):
            raise LabError("stopped before copying the base tree")

    errors = []

    def second_run():
        try:
            prefixbuild.build_each(StopAtCopy(), kernel.queue_for("x86_64"), ("um",))
        except LabError as exc:
            errors.append(str(exc))

    with open(tree.with_name(tree.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        t = threading.Thread(target=second_run)
        t.start()
        t.join(0.5)
        assert not cleared.is_set(), "build-each cleared the tree another build-each holds"
        fcntl.flock(lock, fcntl.LOCK_UN)
    t.join(10)
    assert cleared.is_set() and errors == ["stopped before copying the base tree"]


def test_a_report_drops_the_zero_mark_in_the_patch_that_tracks_it():
    """The first never-zero-twice patch tracks the zero state of free
    blocks, so page reporting isolates known zero blocks from there on; a
    report the device has not vouched for must not put one back as zero,
    in the same patch, not a later one (a bisect would otherwise land on
    kernels that hand out memory the host may have replaced as zero).
    Reporting isolates without taking the state (NULL) and puts back as
    not zero."""
    first = patchqueue.Series.load(kernel.QUEUES["never-zero-twice"].patch_dir).files[0]
    added = added_and_removed(first).get("mm/page_reporting.c", ([], []))[0]
    text = "\n".join(added)
    assert "__isolate_free_page(page, order, NULL)" in text, \
        f"{first.name} does not say how reporting's isolation treats the zero state"
    assert re.search(r"__putback_isolated_page\(page, order, mt,\s*false\)", text), \
        f"{first.name} puts a reported block back without saying it is not zero"


# what the zeroed state of free pages must not be built on (the reviewers'
# design: the state on PageBuddy heads and PCP zero lists, no page flag
# outside PageBuddy, no allocation entry point of its own)
REFUSED_SHAPES = (
    (r"PG_zeroed\s*=\s*PG_", "a page flag alias for the zeroed state"),
    (r"\b__alloc_pages_zeroed\b", "an allocation entry point of its own"),
    (r"\b__folio_alloc_zeroed\b", "an allocation entry point of its own"),
    (r"\bvma_alloc_folio_zeroed\b", "an allocation entry point of its own"),
    (r"\bcheck_new_page\(struct page \*page,", "an exemption in check_new_page()"),
    (r"\bpage->index\s*[|&]?=(?!=)", "sub-block state in page->index of free pages"),
)


def test_the_zeroed_state_has_the_shape_the_reviewers_asked_for():
    added = []
    for name in ("never-zero-twice", "prezero"):
        for patch in kernel.Series.load(kernel.QUEUES[name].patch_dir).files:
            for path, (plus, _) in added_and_removed(patch).items():
                added += [(patch.name, path, ln) for ln in plus if is_code(ln)]
    for pattern, what in REFUSED_SHAPES:
        found = [(p, f, ln.strip()) for p, f, ln in added if re.search(pattern, ln)]
        assert not found, f"{what}: {found}"
    assert any(re.search(r"#define FPI_ZEROED\b", ln) for _, _, ln in added), \
        "no FPI_ZEROED: frees and putbacks do not carry the state"
