//! The host-side effect of inflating / reporting: giving guest pages back to
//! the host, and initializing them when the device promised the guest it
//! would (feature bits 6 and 7, see `spec.rs`).
//!
//! * fd-backed regions (memfd, tmpfs, hugetlbfs — everything the frontend
//!   shares with SET_MEM_TABLE): `fallocate(PUNCH_HOLE | KEEP_SIZE)` on the
//!   file, aligned to the backing page size of the file system (the huge page
//!   size on hugetlbfs). Punching a hole also zaps the page from every shared
//!   mapping, ours and the guest's. If the file system does not support
//!   hole punching, `madvise(MADV_REMOVE)` on our shared mapping is tried.
//!   For a MAP_PRIVATE file mapping the private copy is dropped as well
//!   (`MADV_DONTNEED`).
//! * anonymous regions (unit tests): `MADV_DONTNEED` for private mappings
//!   (reads back zero-filled pages), `MADV_REMOVE` for shared ones.
//!
//! [`treat_range`] decides what happens to one validated range: with a
//! promise to the guest ([`Treatment::ReleaseZeroed`], [`Treatment::Fill`])
//! every byte that was not discarded (a partial huge page, a failed
//! `fallocate`) is written with the pattern through guest memory, and what
//! cannot be written either is returned as uninitialized so that the caller
//! never acknowledges it as initialized.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use thiserror::Error;
use vm_memory::bitmap::Bitmap;
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap, GuestMemoryRegion,
};

use crate::ranges::{split_to_pages, GuestRange};
use crate::spec::PAGE_SIZE;

const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Error of this module.
#[derive(Debug, Error)]
pub enum DiscardError {
    /// The range is not wholly inside one mapped region (should have been
    /// rejected by validation before).
    #[error("range {gpa:#x}+{len:#x} is not inside one mapped region")]
    NotMapped {
        /// guest-physical address
        gpa: u64,
        /// length
        len: u64,
    },
    /// A system call failed.
    #[error("{op} on {gpa:#x}+{len:#x} failed: {source}")]
    Syscall {
        /// which call
        op: &'static str,
        /// guest-physical address
        gpa: u64,
        /// length
        len: u64,
        /// OS error
        source: io::Error,
    },
    /// Writing the fill pattern into guest memory failed.
    #[error("filling {gpa:#x} failed: {source}")]
    Fill {
        /// guest-physical address
        gpa: u64,
        /// cause
        source: GuestMemoryError,
    },
}

/// The dirty bitmap of a guest memory region: inactive until the frontend
/// shares a log (VHOST_USER_SET_LOG_BASE), then every write through guest
/// memory marks the pages it touched in the frontend's log.
pub type LogBitmap = vhost_user_backend::bitmap::BitmapMmapRegion;

/// Guest memory as the backend maps it.
pub type GuestMem = GuestMemoryMmap<LogBitmap>;

/// What a discard did with a range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Discarded {
    /// Bytes released to the host.
    pub discarded: u64,
    /// Parts of the range that were not released (partial huge pages, or
    /// the whole range for a discarder that never releases memory).
    pub rest: Vec<GuestRange>,
}

/// The host-side effect behind inflate and free page reporting.
pub trait Discarder: Send + Sync {
    /// True when `discard` gives memory back to the host so that it reads
    /// as zero afterwards (the device offers bits 6 and 7 only then).
    fn releases_memory(&self) -> bool;

    /// Discards the whole backing pages of `range`, which the caller
    /// validated to lie in one region of `mem`.
    fn discard(&self, mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError>;

    /// Writes `pattern` (little-endian, repeated) over `range` through guest
    /// memory.
    fn fill(&self, mem: &GuestMem, range: GuestRange, pattern: u32) -> Result<(), DiscardError> {
        fill_pattern(mem, range, pattern)
    }
}

/// What the device does with a valid range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Give the memory back, no promise about its content: what cannot be
    /// discarded is left as it is.
    Release,
    /// Give the memory back and initialize it to zero: what cannot be
    /// discarded is zero-filled.
    ReleaseZeroed,
    /// Initialize every byte to `pattern` (PAGE_POISON with a non-zero
    /// `poison_val`): nothing is discarded.
    Fill(u32),
}

/// What [`treat_range`] did, in bytes, plus what it could not initialize.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeOutcome {
    /// Released to the host.
    pub discarded: u64,
    /// Written with zeroes instead of being released.
    pub zero_filled: u64,
    /// Written with a non-zero pattern.
    pub pattern_filled: u64,
    /// Left as they were (no promise: partial huge pages, failed discards).
    pub skipped: u64,
    /// Discard calls that failed.
    pub discard_errors: u64,
    /// Fill attempts that failed.
    pub fill_errors: u64,
    /// Parts the treatment promised to initialize and could not.
    pub uninitialized: Vec<GuestRange>,
}

impl RangeOutcome {
    /// Bytes the treatment could not initialize.
    pub fn uninitialized_bytes(&self) -> u64 {
        self.uninitialized.iter().map(|r| r.len).sum()
    }
}

fn fill_into(
    d: &dyn Discarder,
    mem: &GuestMem,
    r: GuestRange,
    pattern: u32,
    out: &mut RangeOutcome,
    err: &mut Option<DiscardError>,
) {
    match d.fill(mem, r, pattern) {
        Ok(()) if pattern == 0 => out.zero_filled += r.len,
        Ok(()) => out.pattern_filled += r.len,
        Err(e) => {
            out.fill_errors += 1;
            out.uninitialized.push(r);
            err.get_or_insert(e);
        }
    }
}

/// Applies `t` to the validated `range`. Returns the outcome and the first
/// error met (already accounted for in the outcome, for logging).
pub fn treat_range(
    d: &dyn Discarder,
    mem: &GuestMem,
    range: GuestRange,
    t: Treatment,
) -> (RangeOutcome, Option<DiscardError>) {
    let mut out = RangeOutcome::default();
    let mut err = None;
    match t {
        Treatment::Fill(p) => fill_into(d, mem, range, p, &mut out, &mut err),
        Treatment::Release | Treatment::ReleaseZeroed => {
            let rest = match d.discard(mem, range) {
                Ok(x) => {
                    out.discarded = x.discarded;
                    x.rest
                }
                Err(e) => {
                    out.discard_errors = 1;
                    err = Some(e);
                    vec![range]
                }
            };
            for r in rest {
                if t == Treatment::ReleaseZeroed {
                    fill_into(d, mem, r, 0, &mut out, &mut err);
                } else {
                    out.skipped += r.len;
                }
            }
        }
    }
    (out, err)
}

/// Marks `r` dirty in the frontend's migration log (the region's bitmap)
/// and returns whether the log recorded it, i.e. whether a log is active
/// for that region. Writes through guest memory are marked by `vm-memory`
/// itself; a discard changes memory behind its back and needs this.
///
/// The answer can be a false "no" when the frontend collected (and
/// cleared) the bit between the mark and the check: callers treat "no" as
/// "the guest cannot rely on this range", which is the safe side.
pub fn mark_dirty(mem: &GuestMem, r: GuestRange) -> bool {
    let Some(region) = mem.find_region(GuestAddress(r.gpa)) else {
        return false;
    };
    let off = r.gpa - region.start_addr().0;
    let (Ok(off), Ok(len)) = (usize::try_from(off), usize::try_from(r.len)) else {
        return false;
    };
    let bitmap = region.bitmap();
    bitmap.mark_dirty(off, len);
    len > 0 && bitmap.dirty_at(off)
}

/// The real implementation (see module documentation).
#[derive(Debug, Default)]
pub struct HostDiscarder;

/// Does nothing (for `--discard none`): pages stay populated.
#[derive(Debug, Default)]
pub struct NoopDiscarder;

impl Discarder for NoopDiscarder {
    fn releases_memory(&self) -> bool {
        false
    }

    fn discard(&self, _mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError> {
        Ok(Discarded {
            discarded: 0,
            rest: vec![range],
        })
    }
}

/// Page size of the file behind `fd`: the huge page size on hugetlbfs,
/// 4 KiB otherwise.
fn fd_page_size(fd: &std::fs::File) -> u64 {
    // SAFETY: statfs is plain old data; fstatfs only writes into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and valid out pointer.
    let rc = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    #[allow(clippy::unnecessary_cast)]
    if rc == 0 && st.f_type as i64 == HUGETLBFS_MAGIC {
        u64::try_from(st.f_bsize)
            .unwrap_or(PAGE_SIZE)
            .max(PAGE_SIZE)
    } else {
        PAGE_SIZE
    }
}

fn to_off(v: u64, op: &'static str, range: GuestRange) -> Result<libc::off_t, DiscardError> {
    libc::off_t::try_from(v).map_err(|_| DiscardError::Syscall {
        op,
        gpa: range.gpa,
        len: range.len,
        source: io::Error::from_raw_os_error(libc::EOVERFLOW),
    })
}

fn madvise(
    ptr: *mut u8,
    len: u64,
    advice: libc::c_int,
    op: &'static str,
    range: GuestRange,
) -> Result<(), DiscardError> {
    let l = usize::try_from(len).map_err(|_| DiscardError::NotMapped {
        gpa: range.gpa,
        len: range.len,
    })?;
    // SAFETY: `ptr..ptr+len` lies inside a mapping owned by the guest memory
    // object (checked by the caller against the region bounds); madvise does
    // not invalidate the mapping itself, it only drops its contents.
    let rc = unsafe { libc::madvise(ptr.cast(), l, advice) };
    if rc != 0 {
        return Err(DiscardError::Syscall {
            op,
            gpa: range.gpa,
            len: range.len,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Writes `pattern` (little-endian, repeated) over `r`, which must lie in
/// guest memory; the write goes through `mem` (and so through its dirty
/// bitmap).
pub fn fill_pattern(mem: &GuestMem, r: GuestRange, pattern: u32) -> Result<(), DiscardError> {
    const CHUNK: u64 = 64 * 1024;
    let mut buf = [0u8; CHUNK as usize];
    if pattern != 0 {
        for c in buf.chunks_exact_mut(4) {
            c.copy_from_slice(&pattern.to_le_bytes());
        }
    }
    let mut off = 0;
    while off < r.len {
        let n = (r.len - off).min(CHUNK);
        let idx = usize::try_from(n).unwrap_or(buf.len());
        let gpa = r.gpa.checked_add(off).ok_or(DiscardError::NotMapped {
            gpa: r.gpa,
            len: r.len,
        })?;
        mem.write_slice(&buf[..idx], GuestAddress(gpa))
            .map_err(|source| DiscardError::Fill { gpa, source })?;
        off += n;
    }
    Ok(())
}

impl Discarder for HostDiscarder {
    fn releases_memory(&self) -> bool {
        true
    }

    fn discard(&self, mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError> {
        let not_mapped = || DiscardError::NotMapped {
            gpa: range.gpa,
            len: range.len,
        };
        let region = mem
            .find_region(GuestAddress(range.gpa))
            .ok_or_else(not_mapped)?;
        let rstart = region.start_addr().0;
        let in_off = range.gpa - rstart;
        if in_off
            .checked_add(range.len)
            .is_none_or(|e| e > region.len())
        {
            return Err(not_mapped());
        }
        let fo = region.file_offset();
        // Align in the coordinate space of the backing object: the file
        // offset for fd-backed regions, the host address otherwise.
        let host_base = region.as_ptr() as u64;
        let (base, page) = match fo {
            Some(fo) => (fo.start(), fd_page_size(fo.file())),
            None => (host_base, PAGE_SIZE),
        };
        let (whole, partial) = split_to_pages(GuestRange::new(base + in_off, range.len), page);
        let mut out = Discarded::default();
        if let Some(w) = whole {
            let w_in = w.gpa - base; // offset inside the region
            let gpa_range = GuestRange::new(rstart + w_in, w.len);
            let ptr = region
                .as_ptr()
                .wrapping_add(usize::try_from(w_in).map_err(|_| not_mapped())?);
            match fo {
                Some(fo) => {
                    // SAFETY: fallocate on an fd we own (shared via Arc<File>)
                    // with bounds derived from the region's file offset.
                    let rc = unsafe {
                        libc::fallocate(
                            fo.file().as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            to_off(w.gpa, "fallocate", gpa_range)?,
                            to_off(w.len, "fallocate", gpa_range)?,
                        )
                    };
                    if rc != 0 {
                        let e = io::Error::last_os_error();
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
                        ) {
                            madvise(
                                ptr,
                                w.len,
                                libc::MADV_REMOVE,
                                "madvise(MADV_REMOVE)",
                                gpa_range,
                            )?;
                        } else {
                            return Err(DiscardError::Syscall {
                                op: "fallocate(PUNCH_HOLE)",
                                gpa: gpa_range.gpa,
                                len: gpa_range.len,
                                source: e,
                            });
                        }
                    }
                    if region.flags() & libc::MAP_PRIVATE != 0 {
                        madvise(
                            ptr,
                            w.len,
                            libc::MADV_DONTNEED,
                            "madvise(MADV_DONTNEED)",
                            gpa_range,
                        )?;
                    }
                }
                None => {
                    let (adv, op) = if region.flags() & libc::MAP_SHARED != 0 {
                        (libc::MADV_REMOVE, "madvise(MADV_REMOVE)")
                    } else {
                        (libc::MADV_DONTNEED, "madvise(MADV_DONTNEED)")
                    };
                    madvise(ptr, w.len, adv, op, gpa_range)?;
                }
            }
            out.discarded = w.len;
        }
        out.rest = partial
            .into_iter()
            .map(|p| GuestRange::new(rstart + (p.gpa - base), p.len))
            .collect();
        Ok(out)
    }
}

/// Waits before every discard and fill of the discarder it wraps
/// (`--discard-delay-ms`): a host that is slow to give memory back. Reports
/// then stay in flight for as long as a test needs them to.
pub struct DelayedDiscarder {
    inner: Arc<dyn Discarder>,
    delay: Duration,
}

impl DelayedDiscarder {
    /// Wraps `inner`; every call waits `delay` first.
    pub fn new(inner: Arc<dyn Discarder>, delay: Duration) -> Self {
        Self { inner, delay }
    }
}

impl Discarder for DelayedDiscarder {
    fn releases_memory(&self) -> bool {
        self.inner.releases_memory()
    }

    fn discard(&self, mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError> {
        thread::sleep(self.delay);
        self.inner.discard(mem, range)
    }

    fn fill(&self, mem: &GuestMem, range: GuestRange, pattern: u32) -> Result<(), DiscardError> {
        thread::sleep(self.delay);
        self.inner.fill(mem, range, pattern)
    }
}

/// Test double: records every call, "discards" by zero-filling through
/// guest memory (no system call), and fails discards and/or fills on
/// request.
#[derive(Debug, Default)]
pub struct RecordingDiscarder {
    /// Ranges passed to `discard`, in order.
    pub calls: Mutex<Vec<GuestRange>>,
    /// Ranges passed to `fill`, with the pattern, in order.
    pub fills: Mutex<Vec<(GuestRange, u32)>>,
    /// Make every `discard` fail.
    pub fail_discard: AtomicBool,
    /// Make every `fill` fail.
    pub fail_fill: AtomicBool,
}

impl RecordingDiscarder {
    fn failure(range: GuestRange, op: &'static str) -> DiscardError {
        DiscardError::Syscall {
            op,
            gpa: range.gpa,
            len: range.len,
            source: io::Error::from_raw_os_error(libc::EPERM),
        }
    }
}

impl Discarder for RecordingDiscarder {
    fn releases_memory(&self) -> bool {
        true
    }

    fn discard(&self, mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError> {
        if let Ok(mut c) = self.calls.lock() {
            c.push(range);
        }
        if self.fail_discard.load(Ordering::Relaxed) {
            return Err(Self::failure(range, "test discard"));
        }
        fill_pattern(mem, range, 0)?;
        Ok(Discarded {
            discarded: range.len,
            rest: Vec::new(),
        })
    }

    fn fill(&self, mem: &GuestMem, range: GuestRange, pattern: u32) -> Result<(), DiscardError> {
        if let Ok(mut c) = self.fills.lock() {
            c.push((range, pattern));
        }
        if self.fail_fill.load(Ordering::Relaxed) {
            return Err(Self::failure(range, "test fill"));
        }
        fill_pattern(mem, range, pattern)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use vm_memory::{FileOffset, GuestRegionMmap, MmapRegion};

    fn memfd(size: u64) -> File {
        let name = CString::new("discard-test").unwrap();
        // SAFETY: valid C string; we take ownership of the returned fd.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd was just created and is owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        f
    }

    fn blocks(f: &File) -> u64 {
        use std::os::unix::fs::MetadataExt;
        f.metadata().unwrap().blocks()
    }

    #[test]
    fn punch_hole_on_memfd() {
        let size = 1 << 20;
        let f = memfd(size);
        let fcheck = f.try_clone().unwrap();
        let region = MmapRegion::from_file(FileOffset::new(f, 0), size as usize).unwrap();
        let mem = GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(
            region,
            GuestAddress(0x10_0000),
        )
        .unwrap()])
        .unwrap();
        mem.write_slice(&vec![0x5a; size as usize], GuestAddress(0x10_0000))
            .unwrap();
        let before = blocks(&fcheck);
        let out = HostDiscarder
            .discard(&mem, GuestRange::new(0x10_0000 + 8192, 64 * 1024))
            .unwrap();
        assert_eq!(out.discarded, 64 * 1024);
        assert!(blocks(&fcheck) < before);
        let mut buf = vec![1u8; 64 * 1024 + 8192];
        mem.read_slice(&mut buf, GuestAddress(0x10_0000 + 4096))
            .unwrap();
        assert!(
            buf[..4096].iter().all(|&b| b == 0x5a),
            "neighbour below kept"
        );
        assert!(buf[4096..4096 + 64 * 1024].iter().all(|&b| b == 0));
        assert!(
            buf[4096 + 64 * 1024..].iter().all(|&b| b == 0x5a),
            "neighbour above kept"
        );
    }

    #[test]
    fn dontneed_on_private_anon() {
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        mem.write_slice(&[7u8; 8192], GuestAddress(4096)).unwrap();
        let out = HostDiscarder
            .discard(&mem, GuestRange::new(4096, 4096))
            .unwrap();
        assert_eq!(out.discarded, 4096);
        let mut b = [1u8; 8192];
        mem.read_slice(&mut b, GuestAddress(4096)).unwrap();
        assert!(b[..4096].iter().all(|&x| x == 0));
        assert!(b[4096..].iter().all(|&x| x == 7));
    }

    #[test]
    fn outside_region_is_error() {
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        assert!(HostDiscarder
            .discard(&mem, GuestRange::new(1 << 16, 4096))
            .is_err());
        assert!(HostDiscarder
            .discard(&mem, GuestRange::new(0, 1 << 17))
            .is_err());
    }

    #[test]
    fn noop_and_recording() {
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        let o = NoopDiscarder
            .discard(&mem, GuestRange::new(0, 4096))
            .unwrap();
        assert_eq!(o.rest, vec![GuestRange::new(0, 4096)]);
        assert!(!NoopDiscarder.releases_memory());
        let r = RecordingDiscarder::default();
        mem.write_slice(&[3u8; 4096], GuestAddress(0)).unwrap();
        r.discard(&mem, GuestRange::new(0, 4096)).unwrap();
        assert_eq!(r.calls.lock().unwrap().len(), 1);
        let mut b = [1u8; 4096];
        mem.read_slice(&mut b, GuestAddress(0)).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn delayed_waits_then_delegates() {
        let mem = mem_with(5);
        let rec = Arc::new(RecordingDiscarder::default());
        let d = DelayedDiscarder::new(rec.clone(), Duration::from_millis(40));
        assert!(d.releases_memory());
        let t = std::time::Instant::now();
        let o = d.discard(&mem, GuestRange::new(4096, 4096)).unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(o.discarded, 4096);
        assert_eq!(
            *rec.calls.lock().unwrap(),
            vec![GuestRange::new(4096, 4096)]
        );
        assert!(read(&mem, GuestRange::new(4096, 4096))
            .iter()
            .all(|&x| x == 0));
        let t = std::time::Instant::now();
        d.fill(&mem, GuestRange::new(0, 4096), 0xaa).unwrap();
        assert!(
            t.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t.elapsed()
        );
        assert_eq!(rec.fills.lock().unwrap().len(), 1);
    }

    fn mem_with(byte: u8) -> GuestMem {
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        mem.write_slice(&[byte; 1 << 16], GuestAddress(0)).unwrap();
        mem
    }

    fn read(mem: &GuestMem, r: GuestRange) -> Vec<u8> {
        let mut b = vec![0u8; r.len as usize];
        mem.read_slice(&mut b, GuestAddress(r.gpa)).unwrap();
        b
    }

    #[test]
    fn failed_discard_is_zero_filled_only_under_a_promise() {
        let mem = mem_with(7);
        let d = RecordingDiscarder::default();
        d.fail_discard.store(true, Ordering::Relaxed);
        let r = GuestRange::new(4096, 8192);
        // no promise: the pages stay as they are
        let (o, e) = treat_range(&d, &mem, r, Treatment::Release);
        assert!(e.is_some());
        assert_eq!((o.discard_errors, o.skipped, o.zero_filled), (1, 8192, 0));
        assert!(o.uninitialized.is_empty());
        assert!(read(&mem, r).iter().all(|&b| b == 7));
        // promise: zero-filled instead
        let (o, _) = treat_range(&d, &mem, r, Treatment::ReleaseZeroed);
        assert_eq!(
            (o.discard_errors, o.zero_filled, o.fill_errors),
            (1, 8192, 0)
        );
        assert!(o.uninitialized.is_empty());
        assert!(read(&mem, r).iter().all(|&b| b == 0));
    }

    #[test]
    fn unfillable_range_is_reported_uninitialized() {
        let mem = mem_with(7);
        let d = RecordingDiscarder::default();
        d.fail_discard.store(true, Ordering::Relaxed);
        d.fail_fill.store(true, Ordering::Relaxed);
        let r = GuestRange::new(4096, 4096);
        let (o, e) = treat_range(&d, &mem, r, Treatment::ReleaseZeroed);
        assert!(e.is_some());
        assert_eq!(o.uninitialized, vec![r]);
        assert_eq!((o.discard_errors, o.fill_errors), (1, 1));
        let (o, _) = treat_range(&d, &mem, r, Treatment::Fill(0xaaaa_aaaa));
        assert_eq!(o.uninitialized, vec![r]);
        assert_eq!(o.uninitialized_bytes(), 4096);
    }

    #[test]
    fn pattern_fill_never_discards() {
        let mem = mem_with(7);
        let d = RecordingDiscarder::default();
        let r = GuestRange::new(0, 4096);
        let (o, e) = treat_range(&d, &mem, r, Treatment::Fill(0x1234_5678));
        assert!(e.is_none());
        assert_eq!(o.pattern_filled, 4096);
        assert!(d.calls.lock().unwrap().is_empty());
        let b = read(&mem, r);
        assert_eq!(&b[..8], &[0x78, 0x56, 0x34, 0x12, 0x78, 0x56, 0x34, 0x12]);
        // outside guest memory: an error, never a write elsewhere
        assert!(fill_pattern(&mem, GuestRange::new(1 << 16, 4096), 0).is_err());
    }

    #[test]
    fn mark_dirty_reports_an_inactive_log() {
        let mem = mem_with(7);
        // no log shared: marking is a no-op and says so
        assert!(!mark_dirty(&mem, GuestRange::new(0, 4096)));
        assert!(!mark_dirty(&mem, GuestRange::new(1 << 16, 4096)));
    }

    #[test]
    fn noop_discarder_zero_fills_under_a_promise() {
        let mem = mem_with(7);
        let r = GuestRange::new(0, 4096);
        let (o, _) = treat_range(&NoopDiscarder, &mem, r, Treatment::ReleaseZeroed);
        assert_eq!((o.discarded, o.zero_filled), (0, 4096));
        assert!(read(&mem, r).iter().all(|&b| b == 0));
    }
}
