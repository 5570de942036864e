//! Integration test: start the daemon binary and drive it with a small
//! hand-written vhost-user frontend over a real socket, with real shared
//! memfd guest memory.

use std::ffi::CString;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::EventFd;

const GPA: u64 = 0x4000_0000;
const MEM: u64 = 16 << 20;
const QSIZE: u16 = 16;
const MIB: u64 = 1 << 20;

// queue indexes with every feature negotiated
const INFLATE: usize = 0;
const STATS: usize = 2;
const REPORTING: usize = 3;

struct Daemon {
    child: Child,
    sock: PathBuf,
    ctl: PathBuf,
    dir: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait_for(p: &Path) {
    let t = Instant::now();
    while !p.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} never appeared",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn start_daemon(name: &str, extra: &[&str]) -> Daemon {
    let dir = std::env::temp_dir().join(format!("vub-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("balloon.sock");
    let ctl = dir.join("control.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_vhost-user-balloon"))
        .arg("--socket-path")
        .arg(&sock)
        .arg("--control-socket")
        .arg(&ctl)
        .args(["--log-level", "debug", "--initial-target", "1000"])
        .args(extra)
        .spawn()
        .unwrap();
    wait_for(&sock);
    wait_for(&ctl);
    Daemon {
        child,
        sock,
        ctl,
        dir,
    }
}

fn control(d: &Daemon, req: &str) -> Value {
    let mut s = UnixStream::connect(&d.ctl).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(b"\n").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// Polls get_counters until `ok` holds (messages without REPLY_ACK are
/// processed asynchronously by the daemon).
fn wait_counters(d: &Daemon, ok: impl Fn(&Value) -> bool) -> Value {
    let t = Instant::now();
    loop {
        let c = control(d, r#"{"cmd":"get_counters"}"#);
        if ok(&c) {
            return c;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "condition never met: {c}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn memfd(size: u64) -> File {
    let name = CString::new("guest-ram").unwrap();
    // SAFETY: valid C string; we own the returned fd.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh fd owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

/// A split virtqueue laid out by hand in guest memory.
struct TestQueue {
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
}

impl TestQueue {
    fn new(index: usize) -> Self {
        let base = GPA + index as u64 * 0x4000;
        Self {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Posts a chain of (gpa, len, device_writable) buffers.
    fn push(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) {
        let head = self.next_desc;
        for (i, (addr, len, w)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            let last = i + 1 == bufs.len();
            let mut flags = if *w { 2u16 } else { 0 };
            if !last {
                flags |= 1;
            }
            let next = (idx + 1) % QSIZE;
            let d = self.desc + u64::from(idx) * 16;
            mem.write_obj(*addr, GuestAddress(d)).unwrap();
            mem.write_obj(*len, GuestAddress(d + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
            mem.write_obj(next, GuestAddress(d + 14)).unwrap();
            self.next_desc = next;
        }
        let slot = self.avail + 4 + u64::from(self.avail_idx % QSIZE) * 2;
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    fn wait_used(&self, mem: &GuestMemoryMmap, want: u16) {
        let t = Instant::now();
        while self.used_idx(mem) != want {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "used idx stuck at {}",
                self.used_idx(mem)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

struct Guest {
    fe: Frontend,
    mem: GuestMemoryMmap,
    file: File,
    kicks: Vec<EventFd>,
    _calls: Vec<EventFd>,
    queues: Vec<TestQueue>,
}

impl Guest {
    fn hva(&self, gpa: u64) -> u64 {
        self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64
    }

    fn connect(d: &Daemon, backend_req: Option<&dyn AsRawFd>) -> Guest {
        let file = memfd(MEM);
        let region =
            MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEM as usize)
                .unwrap();
        let mem =
            GuestMemoryMmap::from_regions(vec![
                GuestRegionMmap::new(region, GuestAddress(GPA)).unwrap()
            ])
            .unwrap();
        let mut fe = Frontend::connect(&d.sock, 4).unwrap();
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        assert_ne!(features & (1 << 6), 0, "bit 6 offered");
        assert_ne!(features & (1 << 7), 0, "bit 7 offered");
        assert_eq!(features & (1 << 3), 0, "hinting never offered");
        fe.set_features(features).unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::CONFIG));
        let mut want = VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK;
        if backend_req.is_some() {
            want |= VhostUserProtocolFeatures::BACKEND_REQ;
        }
        fe.set_protocol_features(want & pf).unwrap();
        if let Some(fd) = backend_req {
            fe.set_backend_request_fd(fd).unwrap();
        }
        let r = mem.iter().next().unwrap();
        let info = VhostUserMemoryRegionInfo {
            guest_phys_addr: GPA,
            memory_size: MEM,
            userspace_addr: r.as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        };
        fe.set_mem_table(&[info]).unwrap();
        let mut g = Guest {
            fe,
            mem,
            file,
            kicks: Vec::new(),
            _calls: Vec::new(),
            queues: Vec::new(),
        };
        // populate the ring pages up front so that st_blocks only moves
        // because of discards
        g.fill(GPA, MIB, 0);
        for i in 0..4 {
            let q = TestQueue::new(i);
            let cfg = VringConfigData {
                queue_max_size: QSIZE,
                queue_size: QSIZE,
                flags: 0,
                desc_table_addr: g.hva(q.desc),
                used_ring_addr: g.hva(q.used),
                avail_ring_addr: g.hva(q.avail),
                log_addr: None,
            };
            let kick = EventFd::new(0).unwrap();
            let call = EventFd::new(0).unwrap();
            g.fe.set_vring_num(i, QSIZE).unwrap();
            g.fe.set_vring_addr(i, &cfg).unwrap();
            g.fe.set_vring_base(i, 0).unwrap();
            g.fe.set_vring_call(i, &call).unwrap();
            g.fe.set_vring_kick(i, &kick).unwrap();
            g.fe.set_vring_enable(i, true).unwrap();
            g.kicks.push(kick);
            g._calls.push(call);
            g.queues.push(q);
        }
        // Round trip: the messages above ask for no reply, so without it the
        // test could race ahead of the daemon (e.g. `set_target` before the
        // backend request fd was taken over by the shim).
        g.fe.get_features().unwrap();
        g
    }

    fn kick(&self, q: usize) {
        self.kicks[q].write(1).unwrap();
    }

    fn fill(&self, gpa: u64, len: u64, byte: u8) {
        self.mem
            .write_slice(&vec![byte; len as usize], GuestAddress(gpa))
            .unwrap();
    }

    fn read(&self, gpa: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        self.mem.read_slice(&mut v, GuestAddress(gpa)).unwrap();
        v
    }

    fn blocks(&self) -> u64 {
        self.file.metadata().unwrap().blocks()
    }
}

#[test]
fn reporting_discards_and_hostile_ranges_are_rejected() {
    let d = start_daemon("report", &[]);
    let mut g = Guest::connect(&d, None);

    // --- a valid report: two adjacent 2 MiB ranges (coalesced to 4 MiB) ---
    let start = GPA + 4 * MIB;
    g.fill(GPA + MIB, 12 * MIB, 0xab);
    let before = g.blocks();
    g.queues[REPORTING].push(
        &g.mem,
        &[
            (start, (2 * MIB) as u32, true),
            (start + 2 * MIB, (2 * MIB) as u32, true),
        ],
    );
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    // measure before reading: reading a hole of shared memory refaults pages
    let after = g.blocks();
    assert_eq!(
        before - after,
        4 * MIB / 512,
        "st_blocks shrank: {before} -> {after}"
    );
    assert!(
        g.read(start, 4 * MIB).iter().all(|&b| b == 0),
        "reported range reads zero"
    );
    assert!(
        g.read(start - 4096, 4096).iter().all(|&b| b == 0xab),
        "page below untouched"
    );
    assert!(
        g.read(start + 4 * MIB, 4096).iter().all(|&b| b == 0xab),
        "page above untouched"
    );
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["discarded_bytes"], 4 * MIB);
    assert_eq!(c["counters"]["reports"], 1);
    assert_eq!(c["counters"]["reported_ranges"], 2);
    assert_eq!(c["zero_guarantees"]["reported_reads_zero"], true);
    assert_eq!(c["connected"], true);

    // --- hostile ranges: every one rejected, nothing touched ---
    g.fill(GPA + MIB, 15 * MIB, 0xcd);
    let blocks_before = g.blocks();
    g.queues[REPORTING].push(
        &g.mem,
        &[
            (GPA + MEM - 4096, 8192, true), // runs off the end of guest RAM: outside
            (GPA + 8 * MIB + 1, 4096, true), // unaligned start
            (GPA + 8 * MIB, 100, true),     // unaligned length
            (0, 4096, true),                // below guest RAM
            (u64::MAX - 4095, 4096, true),  // wraps the address space: overflow
            (GPA + 9 * MIB, 0, true),       // empty
            (GPA + MEM, u32::MAX, true),    // huge, starts outside: unaligned len
        ],
    );
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 2);
    assert!(
        g.read(GPA + MIB, 15 * MIB).iter().all(|&b| b == 0xcd),
        "no byte of guest RAM changed"
    );
    assert_eq!(g.blocks(), blocks_before);
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    let r = &c["counters"]["rejects"];
    assert_eq!(r["outside_memory"], 3 - 1, "{c}");
    assert_eq!(r["overflow"], 1, "{c}");
    assert_eq!(r["unaligned"], 2, "{c}");
    assert_eq!(r["empty"], 1, "{c}");
    assert_eq!(
        c["counters"]["discarded_bytes"],
        4 * MIB,
        "nothing more discarded"
    );

    // --- the daemon still works after that ---
    g.queues[REPORTING].push(&g.mem, &[(GPA + 12 * MIB, (MIB) as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 3);
    assert!(g.read(GPA + 12 * MIB, MIB).iter().all(|&b| b == 0));
    assert!(g.read(GPA + 13 * MIB, 4096).iter().all(|&b| b == 0xcd));
}

#[test]
fn inflate_stats_config_and_target_over_socket_channel() {
    let d = start_daemon("inflate", &[]);
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let mut g = Guest::connect(&d, Some(&theirs));

    // config space
    let (_, cfg) =
        g.fe.get_config(0, 16, VhostUserConfigFlags::WRITABLE, &[0u8; 16])
            .unwrap();
    assert_eq!(u32::from_le_bytes([cfg[0], cfg[1], cfg[2], cfg[3]]), 1000);
    g.fe.set_config(4, VhostUserConfigFlags::WRITABLE, &77u32.to_le_bytes())
        .unwrap();
    // num_pages is device-owned: the write is ignored (and counted), the
    // connection survives
    g.fe.set_config(0, VhostUserConfigFlags::WRITABLE, &1u32.to_le_bytes())
        .unwrap();
    let c = wait_counters(&d, |c| c["counters"]["config_write_rejects"] == 1);
    assert_eq!(c["actual"], 77);
    assert_eq!(c["target"], 1000);
    assert_eq!(c["counters"]["config_write_rejects"], 1);

    // inflate: PFN array with 3 adjacent pages and one outside RAM
    let data = GPA + 0x10_0000;
    let pages = GPA + 2 * MIB;
    g.fill(pages - 4096, 5 * 4096, 0x11);
    let mut pfns = Vec::new();
    for p in [pages, pages + 4096, pages + 8192, 0x1_0000_0000_0000u64] {
        pfns.extend_from_slice(&((p >> 12) as u32).to_le_bytes());
    }
    g.mem.write_slice(&pfns, GuestAddress(data)).unwrap();
    g.queues[INFLATE].push(&g.mem, &[(data, pfns.len() as u32, false)]);
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    assert!(g.read(pages, 3 * 4096).iter().all(|&b| b == 0));
    assert!(g.read(pages - 4096, 4096).iter().all(|&b| b == 0x11));
    assert!(g.read(pages + 3 * 4096, 4096).iter().all(|&b| b == 0x11));
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["inflated_pages"], 4);
    assert_eq!(c["counters"]["discarded_bytes"], 3 * 4096);
    assert_eq!(c["counters"]["rejects"]["outside_memory"], 1);

    // stats: the device holds the buffer until asked
    let sbuf = GPA + 0x18_0000;
    let mut st = Vec::new();
    for (tag, val) in [(4u16, 123_456u64), (5, 999_999)] {
        st.extend_from_slice(&tag.to_le_bytes());
        st.extend_from_slice(&val.to_le_bytes());
    }
    g.mem.write_slice(&st, GuestAddress(sbuf)).unwrap();
    g.queues[STATS].push(&g.mem, &[(sbuf, st.len() as u32, false)]);
    g.kick(STATS);
    let t = Instant::now();
    loop {
        let s = control(&d, r#"{"cmd":"get_stats","refresh":false}"#);
        if !s["stats"].is_null() {
            assert_eq!(s["stats"]["values"]["free_memory"], 123_456);
            assert_eq!(s["stats"]["values"]["total_memory"], 999_999);
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(g.queues[STATS].used_idx(&g.mem), 0, "stats buffer held");
    let s = control(&d, r#"{"cmd":"get_stats","wait_ms":50}"#);
    assert_eq!(s["ok"], true);
    g.queues[STATS].wait_used(&g.mem, 1); // handed back to request fresh stats

    // set_target -> config change message on the backend channel
    let r = control(&d, r#"{"cmd":"set_target","pages":4096}"#);
    assert_eq!(r["notified"], true, "{r}");
    let mut h = [0u8; 12];
    ours.read_exact(&mut h).unwrap();
    assert_eq!(
        u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
        2,
        "CONFIG_CHANGE_MSG"
    );
    assert_eq!(
        u32::from_le_bytes([h[8], h[9], h[10], h[11]]),
        0,
        "no payload"
    );
    let (_, cfg) =
        g.fe.get_config(0, 16, VhostUserConfigFlags::WRITABLE, &[0u8; 16])
            .unwrap();
    assert_eq!(u32::from_le_bytes([cfg[0], cfg[1], cfg[2], cfg[3]]), 4096);
}

#[test]
fn uml_pipe_channel_reconnect_and_sigterm() {
    let mut d = start_daemon("uml", &[]);
    let mut fds = [0; 2];
    // SAFETY: valid out array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh fds we own.
    let (mut rd, wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    {
        let _g = Guest::connect(&d, Some(&wr));
        drop(wr);
        let r = control(&d, r#"{"cmd":"set_target","pages":77}"#);
        assert_eq!(r["notified"], true, "{r}");
        let mut h = [0u8; 12];
        rd.read_exact(&mut h).unwrap();
        assert_eq!(
            u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
            2,
            "CONFIG_CHANGE_MSG"
        );
        assert_eq!(
            u32::from_le_bytes([h[4], h[5], h[6], h[7]]) & 0x8,
            0,
            "no reply requested on a pipe"
        );
    }
    // frontend gone: the daemon must accept a new one
    std::thread::sleep(Duration::from_millis(100));
    let g2 = Guest::connect(&d, None);
    let (_, cfg) = {
        let mut fe = g2.fe;
        fe.get_config(0, 16, VhostUserConfigFlags::WRITABLE, &[0u8; 16])
            .unwrap()
    };
    assert_eq!(
        u32::from_le_bytes([cfg[0], cfg[1], cfg[2], cfg[3]]),
        77,
        "target survives reconnect"
    );
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["connections"], 2);

    // SIGTERM: clean exit, socket files removed
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let status = d.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!d.sock.exists());
    assert!(!d.ctl.exists());
}
