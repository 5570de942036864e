//! A small hand-written vhost-user frontend that starts the daemon binary and
//! drives it over a real socket, with real shared memfd guest memory.
//!
//! Shared by the integration tests (`tests/frontend.rs`, `mod common;`) and
//! the benchmark (`benches/report_bench.rs`, `#[path]` include). Each target
//! uses a different subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::ffi::CString;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

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
/// How long a test frontend waits for any reply of the daemon: a daemon that
/// hangs fails the test instead of hanging it.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// The daemon's stderr, when it was started with
    /// [`start_daemon_logged`] (otherwise stderr is the test's).
    pub log: Option<PathBuf>,
}

impl Daemon {
    /// Lines the daemon has written to its log file so far.
    pub fn log_lines(&self) -> usize {
        let p = self.log.as_ref().expect("daemon started with a log file");
        std::fs::read(p)
            .map(|b| b.iter().filter(|&&c| c == b'\n').count())
            .unwrap_or(0)
    }

    /// The log lines from line `from` on (for assertion messages).
    pub fn log_since(&self, from: usize, max: usize) -> String {
        let Some(p) = self.log.as_ref() else {
            return String::new();
        };
        let text = std::fs::read_to_string(p).unwrap_or_default();
        let lines: Vec<&str> = text.lines().skip(from).collect();
        let n = lines.len();
        let mut out: Vec<&str> = lines.into_iter().take(max).collect();
        if n > max {
            out.push("...");
        }
        out.join("\n")
    }

    /// `Ok(())` while the daemon runs, otherwise how it ended.
    pub fn alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(match st.signal() {
                Some(sig) => format!("daemon killed by signal {sig} ({st})"),
                None => format!("daemon exited: {st}"),
            }),
            Err(e) => Err(format!("cannot wait for the daemon: {e}")),
        }
    }
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
    spawn_daemon(name, args, false)
}

/// Like [`start_daemon_with`], with the daemon's stderr in a file
/// ([`Daemon::log_lines`] counts its lines).
pub fn start_daemon_logged(name: &str, args: &[&str]) -> Daemon {
    spawn_daemon(name, args, true)
}

fn spawn_daemon(name: &str, args: &[&str], logged: bool) -> Daemon {
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
    let log = logged.then(|| dir.join("daemon.log"));
    let stderr = match &log {
        Some(p) => Stdio::from(File::create(p).unwrap()),
        None => Stdio::inherit(),
    };
    // The test frontends negotiate the experimental bits 6 and 7.
    let child = Command::new(BIN)
        .arg("--socket-path")
        .arg(&sock)
        .arg("--control-socket")
        .arg(&ctl)
        .args(["--x-device-init-reported", "--x-device-init-on-inflate"])
        .args(args)
        .stderr(stderr)
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
        log,
    }
}

/// One request on the JSON-lines control socket.
pub fn control(d: &Daemon, req: &str) -> Value {
    let mut s = UnixStream::connect(&d.ctl).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
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

/// An unlinked regular file in the temp directory (what User-Mode Linux
/// shares as its RAM: not a memfd, no seals).
pub fn tmp_file() -> File {
    let p = std::env::temp_dir().join(format!(
        "vub-ram-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&p)
        .unwrap();
    std::fs::remove_file(&p).unwrap();
    f
}

pub fn memfd(size: u64) -> File {
    memfd_flags(size, 0)
}

/// A memfd sealed against shrinking and growing, as QEMU's
/// `memory-backend-memfd` shares guest RAM (`seal=on`, its default).
pub fn sealed_memfd(size: u64, flags: libc::c_uint) -> File {
    let f = memfd_flags(size, flags | libc::MFD_ALLOW_SEALING);
    add_seals(&f, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
    f
}

pub fn add_seals(f: &File, seals: libc::c_int) {
    // SAFETY: fcntl on a valid fd we own.
    let rc = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    assert_eq!(rc, 0, "seal: {}", io::Error::last_os_error());
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

/// `VRING_DESC_F_NEXT`.
pub const DESC_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE` (device-writable).
pub const DESC_WRITE: u16 = 2;
/// `VRING_DESC_F_INDIRECT`.
pub const DESC_INDIRECT: u16 = 4;

/// Writes one split-ring descriptor at index `idx` of the table at `table`
/// (a ring's table or an indirect table).
pub fn write_desc(
    mem: &GuestMemoryMmap,
    table: u64,
    idx: u16,
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
) {
    let d = table + u64::from(idx) * 16;
    mem.write_obj(addr, GuestAddress(d)).unwrap();
    mem.write_obj(len, GuestAddress(d + 8)).unwrap();
    mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
    mem.write_obj(next, GuestAddress(d + 14)).unwrap();
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
            let mut flags = if *w { DESC_WRITE } else { 0 };
            if !last {
                flags |= DESC_NEXT;
            }
            let next = (idx + 1) % self.size;
            write_desc(mem, self.desc, idx, *addr, *len, flags, next);
            self.next_desc = next;
        }
        self.post(mem, head);
    }

    /// Writes descriptor `idx` of this ring as given (any flags, any next).
    pub fn write_desc(
        &self,
        mem: &GuestMemoryMmap,
        idx: u16,
        addr: u64,
        len: u32,
        flags: u16,
        next: u16,
    ) {
        write_desc(mem, self.desc, idx, addr, len, flags, next);
    }

    /// Puts `head` (any value) in the next avail ring slot and publishes it.
    pub fn post(&mut self, mem: &GuestMemoryMmap, head: u16) {
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
        if let Err(e) = self.try_wait_used(mem, want, Duration::from_secs(10)) {
            panic!("{e}");
        }
    }

    /// Waits until the used index is `want`, at most `timeout`.
    pub fn try_wait_used(
        &self,
        mem: &GuestMemoryMmap,
        want: u16,
        timeout: Duration,
    ) -> Result<(), String> {
        let t = Instant::now();
        while self.used_idx(mem) != want {
            if t.elapsed() > timeout {
                return Err(format!(
                    "used idx stuck at {} (want {want})",
                    self.used_idx(mem)
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
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
    /// Seal guest memory against shrinking (as QEMU does); the daemon
    /// refuses an unsealed memfd.
    pub seal: bool,
    /// Back guest memory with a regular (unlinked) file instead of a memfd,
    /// shared from this file offset on, as User-Mode Linux shares its RAM
    /// file (the file has one byte more than the region's end, like UML's).
    pub regular_file_offset: Option<u64>,
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
            seal: true,
            regular_file_offset: None,
        }
    }
}

/// A `vhost` crate frontend on a socket with [`IO_TIMEOUT`] on every read
/// and write, so that a daemon that stops answering fails the test.
pub fn frontend(d: &Daemon) -> io::Result<Frontend> {
    let s = UnixStream::connect(&d.sock)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(Frontend::from_stream(s, 4))
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
        match Self::try_connect_opts(d, backend_req, o) {
            Ok(g) => g,
            Err(e) => panic!("connect: {e}"),
        }
    }

    /// Like [`Guest::connect_opts`], but a message the daemon refuses (or a
    /// connection it drops) is an error, not a panic.
    pub fn try_connect_opts(
        d: &Daemon,
        backend_req: Option<&dyn AsRawFd>,
        o: &Opts,
    ) -> Result<Guest, String> {
        let (mem_size, qsize) = (o.mem_size, o.qsize);
        let offset = o.regular_file_offset.unwrap_or(0);
        let file = if o.regular_file_offset.is_some() {
            let f = tmp_file();
            f.set_len(offset + mem_size + 1).unwrap();
            f
        } else if o.seal {
            sealed_memfd(mem_size, o.memfd_flags)
        } else {
            memfd_flags(mem_size, o.memfd_flags)
        };
        let region = MmapRegion::from_file(
            FileOffset::new(file.try_clone().unwrap(), offset),
            mem_size as usize,
        )
        .unwrap();
        let mem =
            GuestMemoryMmap::from_regions(vec![
                GuestRegionMmap::new(region, GuestAddress(GPA)).unwrap()
            ])
            .unwrap();
        let e = |what: &str, err: vhost::Error| format!("{what}: {err}");
        let mut fe = frontend(d).map_err(|err| format!("connect: {err}"))?;
        fe.set_owner().map_err(|err| e("SET_OWNER", err))?;
        let features = fe.get_features().map_err(|err| e("GET_FEATURES", err))?;
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
            .map_err(|err| e("SET_FEATURES", err))?;
        let pf = fe
            .get_protocol_features()
            .map_err(|err| e("GET_PROTOCOL_FEATURES", err))?;
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
        fe.set_protocol_features(want & pf)
            .map_err(|err| e("SET_PROTOCOL_FEATURES", err))?;
        if let Some(fd) = backend_req {
            fe.set_backend_request_fd(fd)
                .map_err(|err| e("SET_BACKEND_REQ_FD", err))?;
        }
        let r = mem.iter().next().unwrap();
        let info = VhostUserMemoryRegionInfo {
            guest_phys_addr: GPA,
            memory_size: mem_size,
            userspace_addr: r.as_ptr() as u64,
            mmap_offset: offset,
            mmap_handle: file.as_raw_fd(),
        };
        fe.set_mem_table(&[info])
            .map_err(|err| e("SET_MEM_TABLE", err))?;
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
            g.fe.set_vring_num(i, qsize)
                .map_err(|err| e("SET_VRING_NUM", err))?;
            g.fe.set_vring_addr(i, &cfg)
                .map_err(|err| e("SET_VRING_ADDR", err))?;
            g.fe.set_vring_base(i, 0)
                .map_err(|err| e("SET_VRING_BASE", err))?;
            g.fe.set_vring_call(i, &call)
                .map_err(|err| e("SET_VRING_CALL", err))?;
            g.fe.set_vring_kick(i, &kick)
                .map_err(|err| e("SET_VRING_KICK", err))?;
            g.fe.set_vring_enable(i, true)
                .map_err(|err| e("SET_VRING_ENABLE", err))?;
            g.kicks.push(kick);
            g.calls.push(call);
            g.queues.push(q);
        }
        // Round trip: the messages above ask for no reply, so without it the
        // caller could race ahead of the daemon (e.g. `set_target` before the
        // backend request fd was taken over by the shim).
        g.fe.get_features().map_err(|err| e("GET_FEATURES", err))?;
        Ok(g)
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

/// vhost-user request codes (frontend -> backend) the raw frontend sends.
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const RESET_DEVICE: u32 = 34;
}

/// Header flag: protocol version 1.
pub const HDR_VERSION: u32 = 0x1;
/// Header flag: this is a reply.
pub const HDR_REPLY: u32 = 0x4;
/// Header flag: the frontend wants an ack (REPLY_ACK).
pub const HDR_NEED_REPLY: u32 = 0x8;

/// One `VhostUserMemoryRegion` of a SET_MEM_TABLE payload.
#[derive(Clone, Copy, Debug)]
pub struct RawRegion {
    pub gpa: u64,
    pub size: u64,
    pub user_addr: u64,
    pub mmap_offset: u64,
}

/// SET_MEM_TABLE payload: `num`, padding, then `slots` (which may be more
/// or fewer than `num`).
pub fn mem_table_payload(num: u32, slots: &[RawRegion]) -> Vec<u8> {
    let mut p = num.to_le_bytes().to_vec();
    p.extend_from_slice(&[0; 4]);
    for r in slots {
        for v in [r.gpa, r.size, r.user_addr, r.mmap_offset] {
            p.extend_from_slice(&v.to_le_bytes());
        }
    }
    p
}

/// Payload of a `VhostUserVringState` (index, num).
pub fn vring_state(index: u32, num: u32) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend_from_slice(&num.to_le_bytes());
    p
}

/// A frontend that writes vhost-user messages byte by byte, so that it can
/// send what no real frontend would. Every read and write times out after
/// [`IO_TIMEOUT`].
pub struct RawFrontend {
    pub sock: UnixStream,
}

impl RawFrontend {
    pub fn connect(d: &Daemon) -> io::Result<Self> {
        let sock = UnixStream::connect(&d.sock)?;
        sock.set_read_timeout(Some(IO_TIMEOUT))?;
        sock.set_write_timeout(Some(IO_TIMEOUT))?;
        Ok(Self { sock })
    }

    /// Sends `bytes` as they are, with `fds` attached.
    pub fn send_bytes(&self, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let mut sent = 0;
        let mut fds = fds;
        while sent < bytes.len() {
            let n = self
                .sock
                .send_with_fds(&[&bytes[sent..]], fds)
                .map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
            sent += n;
            fds = &[];
        }
        Ok(())
    }

    /// Sends one message whose header announces `size` payload bytes.
    pub fn send_sized(
        &self,
        request: u32,
        flags: u32,
        size: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> io::Result<()> {
        let mut m = request.to_le_bytes().to_vec();
        m.extend_from_slice(&flags.to_le_bytes());
        m.extend_from_slice(&size.to_le_bytes());
        m.extend_from_slice(payload);
        self.send_bytes(&m, fds)
    }

    /// Sends one well-formed message (version 1, header size = payload).
    pub fn send(&self, request: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        let size = u32::try_from(payload.len()).unwrap();
        self.send_sized(request, HDR_VERSION, size, payload, fds)
    }

    /// Receives one message: (request, flags, payload).
    pub fn recv(&self) -> io::Result<(u32, u32, Vec<u8>)> {
        let mut s = &self.sock;
        let mut h = [0u8; 12];
        s.read_exact(&mut h)?;
        let rd = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let mut p = vec![0u8; rd(8) as usize];
        s.read_exact(&mut p)?;
        Ok((rd(0), rd(4), p))
    }

    /// Sends `request` and returns the payload of its reply.
    pub fn call(&self, request: u32, payload: &[u8]) -> io::Result<Vec<u8>> {
        self.send(request, payload, &[])?;
        let (r, flags, p) = self.recv()?;
        if r != request || flags & HDR_REPLY == 0 {
            return Err(io::Error::other(format!(
                "reply {r} flags {flags:#x} to request {request}"
            )));
        }
        Ok(p)
    }

    /// Sends `request` asking for an ack (REPLY_ACK must be negotiated) and
    /// returns the ack value (0: success).
    pub fn acked(&self, request: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<u64> {
        let size = u32::try_from(payload.len()).unwrap();
        self.send_sized(request, HDR_VERSION | HDR_NEED_REPLY, size, payload, fds)?;
        let (r, _, p) = self.recv()?;
        if r != request || p.len() != 8 {
            return Err(io::Error::other(format!("bad ack to {request}: {r} {p:?}")));
        }
        Ok(u64::from_le_bytes(p.try_into().unwrap()))
    }

    /// GET_FEATURES.
    pub fn get_u64(&self, request: u32) -> io::Result<u64> {
        let p = self.call(request, &[])?;
        let b: [u8; 8] = p
            .try_into()
            .map_err(|_| io::Error::other("short u64 reply"))?;
        Ok(u64::from_le_bytes(b))
    }

    /// SET_OWNER, features (every offered one but LOG_ALL), protocol
    /// features CONFIG | REPLY_ACK | `protocol`. Returns the virtio features.
    pub fn handshake(&self, protocol: VhostUserProtocolFeatures) -> io::Result<u64> {
        self.send(req::SET_OWNER, &[], &[])?;
        let f = self.get_u64(req::GET_FEATURES)? & !LOG_ALL;
        self.send(req::SET_FEATURES, &f.to_le_bytes(), &[])?;
        let pf = self.get_u64(req::GET_PROTOCOL_FEATURES)?;
        let want =
            (VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK | protocol)
                .bits()
                & pf;
        self.send(req::SET_PROTOCOL_FEATURES, &want.to_le_bytes(), &[])?;
        Ok(f)
    }

    /// True when the daemon closed the connection: a read sees EOF (or a
    /// reset) within `within`. Stray replies are skipped.
    pub fn closed_within(&self, within: Duration) -> bool {
        let t = Instant::now();
        let _ = self.sock.set_read_timeout(Some(Duration::from_millis(50)));
        let mut buf = [0u8; 4096];
        let res = loop {
            match (&self.sock).read(&mut buf) {
                Ok(0) => break true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => break true,
                Err(_) if t.elapsed() < within => {}
                Err(_) => break false,
            }
        };
        let _ = self.sock.set_read_timeout(Some(IO_TIMEOUT));
        res
    }
}
