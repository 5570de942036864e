//! A small hand-written vhost-user frontend that starts the daemon binary and
//! drives it over a real socket, with real shared memfd guest memory.
//!
//! Shared by the integration tests (`tests/frontend.rs`, `mod common;`) and
//! the benchmark (`benches/report_bench.rs`, `#[path]` include). Each target
//! uses a different subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::ffi::CString;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::Value;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestRegionMmap,
    MmapRegion,
};
use vmm_sys_util::eventfd::EventFd;

/// Path of the daemon binary cargo built for this test/bench target.
pub const BIN: &str = env!("CARGO_BIN_EXE_vhost-user-balloon");

/// Guest-physical base of the single memory region.
pub const GPA: u64 = 0x4000_0000;
/// Default guest memory size (tests).
pub const MEM: u64 = 16 << 20;
/// Default ring size (tests).
pub const QSIZE: u16 = 16;
pub const MIB: u64 = 1 << 20;
/// `VHOST_F_LOG_ALL`.
pub const LOG_ALL: u64 = 1 << 26;

// queue indexes with every feature negotiated
pub const INFLATE: usize = 0;
pub const STATS: usize = 2;
pub const REPORTING: usize = 3;

pub struct Daemon {
    pub child: Child,
    pub sock: PathBuf,
    pub ctl: PathBuf,
    pub dir: PathBuf,
    /// The command line the daemon was started with (for reports).
    pub cmdline: String,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn wait_for(p: &Path) {
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

/// Starts the daemon the way the tests want it: debug logging, a target of
/// 1000 pages, plus `extra` options.
pub fn start_daemon(name: &str, extra: &[&str]) -> Daemon {
    let mut args = vec!["--log-level", "debug", "--initial-target", "1000"];
    args.extend_from_slice(extra);
    start_daemon_with(name, &args)
}

/// Starts the daemon with sockets in a fresh temp directory and exactly
/// `args` after `--socket-path`/`--control-socket`.
pub fn start_daemon_with(name: &str, args: &[&str]) -> Daemon {
    let dir = std::env::temp_dir().join(format!("vub-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("balloon.sock");
    let ctl = dir.join("control.sock");
    let cmdline = format!(
        "{BIN} --socket-path {} --control-socket {} {}",
        sock.display(),
        ctl.display(),
        args.join(" ")
    );
    let child = Command::new(BIN)
        .arg("--socket-path")
        .arg(&sock)
        .arg("--control-socket")
        .arg(&ctl)
        .args(args)
        .spawn()
        .unwrap();
    wait_for(&sock);
    wait_for(&ctl);
    Daemon {
        child,
        sock,
        ctl,
        dir,
        cmdline,
    }
}

/// One request on the JSON-lines control socket.
pub fn control(d: &Daemon, req: &str) -> Value {
    let mut s = UnixStream::connect(&d.ctl).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(b"\n").unwrap();
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}

/// Polls get_counters until `ok` holds (messages without REPLY_ACK are
/// processed asynchronously by the daemon).
pub fn wait_counters(d: &Daemon, ok: impl Fn(&Value) -> bool) -> Value {
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

pub fn memfd(size: u64) -> File {
    memfd_flags(size, 0)
}

/// A memfd with extra `memfd_create` flags (e.g. `MFD_ALLOW_SEALING`).
pub fn memfd_flags(size: u64, flags: libc::c_uint) -> File {
    let name = CString::new("guest-ram").unwrap();
    // SAFETY: valid C string; we own the returned fd.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | flags) };
    assert!(fd >= 0);
    // SAFETY: fresh fd owned by nobody else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

/// A split virtqueue laid out by hand in guest memory (16 KiB per queue:
/// descriptor table, avail ring, used ring, one 4 KiB page each, so at most
/// 256 entries).
pub struct TestQueue {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
    pub next_desc: u16,
    pub avail_idx: u16,
}

impl TestQueue {
    pub fn new(index: usize, size: u16) -> Self {
        assert!(size.is_power_of_two() && size <= 256);
        let base = GPA + index as u64 * 0x4000;
        Self {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            size,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    /// Posts a chain of (gpa, len, device_writable) buffers.
    pub fn push(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) {
        assert!(bufs.len() <= usize::from(self.size));
        let head = self.next_desc;
        for (i, (addr, len, w)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            let last = i + 1 == bufs.len();
            let mut flags = if *w { 2u16 } else { 0 };
            if !last {
                flags |= 1;
            }
            let next = (idx + 1) % self.size;
            let d = self.desc + u64::from(idx) * 16;
            mem.write_obj(*addr, GuestAddress(d)).unwrap();
            mem.write_obj(*len, GuestAddress(d + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
            mem.write_obj(next, GuestAddress(d + 14)).unwrap();
            self.next_desc = next;
        }
        let slot = self.avail + 4 + u64::from(self.avail_idx % self.size) * 2;
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    /// `(id, len)` of used ring element `i`.
    pub fn used_elem(&self, mem: &GuestMemoryMmap, i: u16) -> (u32, u32) {
        let e = self.used + 4 + u64::from(i % self.size) * 8;
        (
            mem.read_obj(GuestAddress(e)).unwrap(),
            mem.read_obj(GuestAddress(e + 4)).unwrap(),
        )
    }

    /// Used length of used ring element `i`.
    pub fn used_len(&self, mem: &GuestMemoryMmap, i: u16) -> u32 {
        self.used_elem(mem, i).1
    }

    pub fn wait_used(&self, mem: &GuestMemoryMmap, want: u16) {
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

/// How [`Guest::connect_opts`] connects.
pub struct Opts {
    /// Guest memory size.
    pub mem_size: u64,
    /// Ring size.
    pub qsize: u16,
    /// Virtio feature bits the frontend does not accept (mask).
    pub clear_features: u64,
    /// Assert that bits 6 and 7 are offered.
    pub require_init_bits: bool,
    /// Protocol features to negotiate on top of CONFIG and REPLY_ACK.
    pub protocol: VhostUserProtocolFeatures,
    /// Extra `memfd_create` flags for guest memory.
    pub memfd_flags: libc::c_uint,
    /// Accept VHOST_F_LOG_ALL (a migrating frontend); off by default, as a
    /// frontend sets it only while it migrates.
    pub log_all: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            mem_size: MEM,
            qsize: QSIZE,
            clear_features: 0,
            require_init_bits: true,
            protocol: VhostUserProtocolFeatures::empty(),
            memfd_flags: 0,
            log_all: false,
        }
    }
}

/// The frontend side: one memfd region at [`GPA`], four rings.
pub struct Guest {
    pub fe: Frontend,
    pub mem: GuestMemoryMmap,
    pub file: File,
    pub size: u64,
    pub kicks: Vec<EventFd>,
    pub calls: Vec<EventFd>,
    pub queues: Vec<TestQueue>,
}

impl Guest {
    pub fn hva(&self, gpa: u64) -> u64 {
        self.mem.get_host_address(GuestAddress(gpa)).unwrap() as u64
    }

    /// Connects with [`MEM`] bytes of guest memory and [`QSIZE`]-entry rings.
    pub fn connect(d: &Daemon, backend_req: Option<&dyn AsRawFd>) -> Guest {
        Self::connect_with(d, backend_req, MEM, QSIZE)
    }

    /// Negotiates every offered feature, shares `mem_size` bytes of memfd
    /// memory and sets up four `qsize`-entry rings in its first MiB.
    pub fn connect_with(
        d: &Daemon,
        backend_req: Option<&dyn AsRawFd>,
        mem_size: u64,
        qsize: u16,
    ) -> Guest {
        Self::connect_opts(
            d,
            backend_req,
            &Opts {
                mem_size,
                qsize,
                ..Opts::default()
            },
        )
    }

    /// Connects as described by `o`.
    pub fn connect_opts(d: &Daemon, backend_req: Option<&dyn AsRawFd>, o: &Opts) -> Guest {
        let (mem_size, qsize) = (o.mem_size, o.qsize);
        let file = memfd_flags(mem_size, o.memfd_flags);
        let region = MmapRegion::from_file(
            FileOffset::new(file.try_clone().unwrap(), 0),
            mem_size as usize,
        )
        .unwrap();
        let mem =
            GuestMemoryMmap::from_regions(vec![
                GuestRegionMmap::new(region, GuestAddress(GPA)).unwrap()
            ])
            .unwrap();
        let mut fe = Frontend::connect(&d.sock, 4).unwrap();
        fe.set_owner().unwrap();
        let features = fe.get_features().unwrap();
        if o.require_init_bits {
            assert_ne!(features & (1 << 6), 0, "bit 6 offered");
            assert_ne!(features & (1 << 7), 0, "bit 7 offered");
        }
        assert_eq!(features & (1 << 3), 0, "hinting never offered");
        let log_all = if o.log_all {
            assert_ne!(features & LOG_ALL, 0, "LOG_ALL offered");
            0
        } else {
            LOG_ALL
        };
        fe.set_features(features & !o.clear_features & !log_all)
            .unwrap();
        let pf = fe.get_protocol_features().unwrap();
        assert!(pf.contains(VhostUserProtocolFeatures::CONFIG));
        assert!(
            pf.contains(o.protocol),
            "protocol features {:?} offered (offer: {pf:?})",
            o.protocol
        );
        let mut want =
            VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK | o.protocol;
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
            memory_size: mem_size,
            userspace_addr: r.as_ptr() as u64,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        };
        fe.set_mem_table(&[info]).unwrap();
        let mut g = Guest {
            fe,
            mem,
            file,
            size: mem_size,
            kicks: Vec::new(),
            calls: Vec::new(),
            queues: Vec::new(),
        };
        // populate the ring pages up front so that st_blocks only moves
        // because of discards
        g.fill(GPA, MIB, 0);
        for i in 0..4 {
            let q = TestQueue::new(i, qsize);
            let cfg = VringConfigData {
                queue_max_size: qsize,
                queue_size: qsize,
                flags: 0,
                desc_table_addr: g.hva(q.desc),
                used_ring_addr: g.hva(q.used),
                avail_ring_addr: g.hva(q.avail),
                log_addr: None,
            };
            let kick = EventFd::new(0).unwrap();
            let call = EventFd::new(0).unwrap();
            g.fe.set_vring_num(i, qsize).unwrap();
            g.fe.set_vring_addr(i, &cfg).unwrap();
            g.fe.set_vring_base(i, 0).unwrap();
            g.fe.set_vring_call(i, &call).unwrap();
            g.fe.set_vring_kick(i, &kick).unwrap();
            g.fe.set_vring_enable(i, true).unwrap();
            g.kicks.push(kick);
            g.calls.push(call);
            g.queues.push(q);
        }
        // Round trip: the messages above ask for no reply, so without it the
        // caller could race ahead of the daemon (e.g. `set_target` before the
        // backend request fd was taken over by the shim).
        g.fe.get_features().unwrap();
        g
    }

    pub fn kick(&self, q: usize) {
        self.kicks[q].write(1).unwrap();
    }

    pub fn fill(&self, gpa: u64, len: u64, byte: u8) {
        self.mem
            .write_slice(&vec![byte; len as usize], GuestAddress(gpa))
            .unwrap();
    }

    pub fn read(&self, gpa: u64, len: u64) -> Vec<u8> {
        let mut v = vec![0u8; len as usize];
        self.mem.read_slice(&mut v, GuestAddress(gpa)).unwrap();
        v
    }

    /// 512-byte blocks allocated to the guest-memory file.
    pub fn blocks(&self) -> u64 {
        self.file.metadata().unwrap().blocks()
    }
}
