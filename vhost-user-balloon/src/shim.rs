//! Connection shim between the frontend socket and the vhost-user-backend
//! library.
//!
//! Why it exists:
//! * The library only accepts an `AF_UNIX` stream socket in
//!   `VHOST_USER_SET_BACKEND_REQ_FD` (anything else is NACKed and the
//!   connection dropped); some frontends pass a pipe there.
//! * The library's `Backend` cannot send `CONFIG_CHANGE_MSG`.
//! * User-Mode Linux (`arch/um/drivers/virtio_uml.c`) sends SET_MEM_TABLE
//!   with unused region slots, which the library rejects
//!   ([`normalize_mem_table`]).
//! * UML re-probes a driver without ever stopping its rings
//!   (no GET_VRING_BASE); [`RingTracker`] stops them in the library.
//!
//! * The library maps the regions of SET_MEM_TABLE (and the log of
//!   SET_LOG_BASE) as they come and makes the new map current before the
//!   backend hears of it; a region past the end of its file, or a memfd the
//!   frontend can truncate, would end the daemon with SIGBUS. The shim checks
//!   the files first ([`check_request`], [`crate::memfile`]), and refuses
//!   split rings whose size is not a power of two.
//!
//! So the shim relays every message, except that the fd of
//! SET_BACKEND_REQ_FD is kept here as a [`BackendChannel`] (used to send
//! config change notifications, without asking for a reply) and the library
//! gets one end of a socketpair instead; whatever the library sends on it is
//! bridged to the real channel, replies it waits for (REPLY_ACK) are
//! synthesised locally. Replies from the library are relayed message by
//! message, minus the replies to the shim's own GET_VRING_BASE requests. A
//! message the shim refuses is answered with a NACK (when the frontend asked
//! for an ack) and the connection is closed, as the library does with the
//! messages it refuses. The shim also observes SET_PROTOCOL_FEATURES for the
//! counters.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use log::{debug, warn, Level};
use thiserror::Error;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::memfile::{check_shared_file, MemFileError};
use crate::metrics::log_sparse;

/// `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` (backend -> frontend).
pub const BACKEND_CONFIG_CHANGE_MSG: u32 = 2;
/// `VHOST_USER_SET_PROTOCOL_FEATURES`.
pub const REQ_SET_PROTOCOL_FEATURES: u32 = 16;
/// `VHOST_USER_SET_BACKEND_REQ_FD` (`SET_SLAVE_REQ_FD`).
pub const REQ_SET_BACKEND_REQ_FD: u32 = 21;
/// `VHOST_USER_SET_CONFIG`.
pub const REQ_SET_CONFIG: u32 = 25;
/// SET_CONFIG `flags`: the spec's value 1, "used for live migration"
/// (QEMU's `VHOST_SET_CONFIG_TYPE_MIGRATION`; QEMU sends 0 for a driver's
/// write). The `vhost` crate reads the field as bit flags (its `WRITABLE`
/// is 1) and does not hand it to the backend.
pub const CONFIG_FLAGS_MIGRATION: u32 = 1;
/// `struct VhostUserConfig` header (offset, size, flags).
const CONFIG_HDR: usize = 12;
/// `VHOST_USER_SET_MEM_TABLE`.
pub const REQ_SET_MEM_TABLE: u32 = 5;
/// `VHOST_USER_SET_LOG_BASE`.
pub const REQ_SET_LOG_BASE: u32 = 6;
/// `VHOST_USER_GET_FEATURES`.
pub const REQ_GET_FEATURES: u32 = 1;
/// `VHOST_USER_SET_FEATURES`.
pub const REQ_SET_FEATURES: u32 = 2;
/// `VHOST_USER_SET_VRING_NUM`.
pub const REQ_SET_VRING_NUM: u32 = 8;
/// `VHOST_USER_SET_VRING_ADDR`.
pub const REQ_SET_VRING_ADDR: u32 = 9;
/// `VHOST_USER_SET_VRING_BASE`.
pub const REQ_SET_VRING_BASE: u32 = 10;
/// `VHOST_USER_GET_VRING_BASE`.
pub const REQ_GET_VRING_BASE: u32 = 11;
/// `VHOST_USER_SET_VRING_KICK`.
pub const REQ_SET_VRING_KICK: u32 = 12;
/// `VHOST_USER_SET_VRING_CALL`.
pub const REQ_SET_VRING_CALL: u32 = 13;
/// `VHOST_USER_F_PROTOCOL_FEATURES` (virtio feature bit 30).
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// `VHOST_USER_PROTOCOL_F_REPLY_ACK`.
const PROTOCOL_F_REPLY_ACK: u64 = 1 << 3;
/// How long a message half written to the backend request channel may wait
/// for the frontend to make room for the rest.
const PARTIAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// SET_VRING_KICK/CALL payload: no fd attached.
const VRING_NOFD_MASK: u64 = 0x100;
/// Rings the tracker knows about (vhost-user indexes are 8 bits; the
/// device has 4).
const MAX_RINGS: usize = 64;
/// `struct VhostUserMemory` header (num_regions, padding).
pub const MEM_TABLE_HDR: usize = 8;
/// `struct VhostUserMemoryRegion` (guest_phys_addr, size, user_addr, mmap_offset).
pub const MEM_REGION_SIZE: usize = 32;
/// Header size: request, flags, size (all u32).
pub const HDR_SIZE: usize = 12;
const FLAG_VERSION: u32 = 0x1;
const FLAG_REPLY: u32 = 0x4;
const FLAG_NEED_REPLY: u32 = 0x8;
/// Largest payload we relay (the spec's messages are far smaller).
pub const MAX_PAYLOAD: usize = 64 * 1024;
const MAX_FDS: usize = 32;

/// Error of this module.
#[derive(Debug, Error)]
pub enum ShimError {
    /// Socket I/O failed.
    #[error("shim I/O: {0}")]
    Io(#[from] io::Error),
    /// A message announced an absurd payload size.
    #[error("message payload of {0} bytes is too large")]
    TooLarge(u32),
    /// Spawning a relay thread failed.
    #[error("cannot spawn relay thread: {0}")]
    Spawn(io::Error),
    /// A region of SET_MEM_TABLE (or the log of SET_LOG_BASE) cannot be
    /// mapped without risking SIGBUS.
    #[error("refused {what}: {source}")]
    SharedFile {
        /// which region or log
        what: String,
        /// why
        source: MemFileError,
    },
    /// SET_MEM_TABLE with a different number of fds than regions.
    #[error("refused SET_MEM_TABLE with {regions} region(s) and {fds} fd(s)")]
    FdCount {
        /// regions announced
        regions: u32,
        /// fds attached
        fds: usize,
    },
    /// SET_VRING_NUM with a size that is not a power of two.
    #[error("refused SET_VRING_NUM {num} for ring {index}: a split ring's size is a power of two")]
    RingSize {
        /// ring index
        index: u32,
        /// requested size
        num: u32,
    },
}

fn u64_at(p: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(p.get(off..off + 8)?.try_into().ok()?))
}

/// Checks a frontend message before the library sees it (`payload`
/// without the header, after [`normalize_mem_table`]):
///
/// * SET_MEM_TABLE: one fd per region, and every region's file passes
///   [`check_shared_file`] for `mmap_offset + memory_size`;
/// * SET_LOG_BASE: the log's file passes it for `mmap_offset + mmap_size`;
/// * SET_VRING_NUM: the size is a power of two (virtio 1.2 2.7).
///
/// Malformed payloads are left to the library, which refuses them.
pub fn check_request(request: u32, payload: &[u8], fds: &[OwnedFd]) -> Result<(), ShimError> {
    match request {
        REQ_SET_MEM_TABLE => {
            let Some(num) = payload_u32(payload) else {
                return Ok(());
            };
            let n = usize::try_from(num).unwrap_or(usize::MAX);
            if n != fds.len() {
                return Err(ShimError::FdCount {
                    regions: num,
                    fds: fds.len(),
                });
            }
            for (i, fd) in fds.iter().enumerate() {
                let base = MEM_TABLE_HDR + i * MEM_REGION_SIZE;
                // guest_phys_addr, memory_size, userspace_addr, mmap_offset
                let (Some(size), Some(offset)) =
                    (u64_at(payload, base + 8), u64_at(payload, base + 24))
                else {
                    return Ok(());
                };
                check_shared_file(fd.as_fd(), offset, size).map_err(|source| {
                    ShimError::SharedFile {
                        what: format!("memory region {i}"),
                        source,
                    }
                })?;
            }
            Ok(())
        }
        REQ_SET_LOG_BASE => {
            // mmap_size, mmap_offset
            let (Some(size), Some(offset), [fd]) = (u64_at(payload, 0), u64_at(payload, 8), fds)
            else {
                return Ok(());
            };
            check_shared_file(fd.as_fd(), offset, size).map_err(|source| {
                ShimError::SharedFile {
                    what: "dirty log".into(),
                    source,
                }
            })?;
            Ok(())
        }
        REQ_SET_VRING_NUM => {
            let (Some(index), Some(num)) = (payload_u32(payload), payload_u32_at(payload, 4))
            else {
                return Ok(());
            };
            if num.is_power_of_two() {
                Ok(())
            } else {
                Err(ShimError::RingSize { index, num })
            }
        }
        _ => Ok(()),
    }
}

/// Trims the unused tail of a SET_MEM_TABLE payload.
///
/// User-Mode Linux (`vhost_user_set_mem_table()` in
/// `arch/um/drivers/virtio_uml.c`) always sends the whole fixed-size
/// `struct vhost_user_mem_regions` (room for 2 regions, 72 bytes) and sets
/// `num` to the regions actually used (1 unless UML has highmem). The `vhost`
/// crate insists on `size == 8 + num * 32` and answers anything else with
/// a NACK and a dropped connection. The unused slots carry no information,
/// so the message is cut down to `num` regions. `msg` is the whole message
/// (header + payload); returns the number of bytes removed. Messages that are
/// already exact, too short or claim more regions than they carry are left
/// alone (the library rejects the broken ones).
pub fn normalize_mem_table(msg: &mut Vec<u8>) -> usize {
    if msg.len() < HDR_SIZE + MEM_TABLE_HDR {
        return 0;
    }
    let mut h = [0u8; HDR_SIZE];
    h.copy_from_slice(&msg[..HDR_SIZE]);
    let mut hdr = Header::parse(&h);
    if hdr.request != REQ_SET_MEM_TABLE {
        return 0;
    }
    let p = &msg[HDR_SIZE..];
    let num = u32::from_le_bytes([p[0], p[1], p[2], p[3]]);
    let Some(want) = usize::try_from(num)
        .ok()
        .and_then(|n| n.checked_mul(MEM_REGION_SIZE))
        .and_then(|n| n.checked_add(MEM_TABLE_HDR))
    else {
        return 0;
    };
    if num == 0 || want >= p.len() {
        return 0;
    }
    let cut = p.len() - want;
    msg.truncate(HDR_SIZE + want);
    // `want` < the received size, which fit in a u32.
    hdr.size = u32::try_from(want).unwrap_or(hdr.size);
    msg[..HDR_SIZE].copy_from_slice(&hdr.to_bytes());
    cut
}

/// What the shim does to the library before relaying a frontend message.
#[derive(Debug, PartialEq, Eq)]
pub struct RingStop {
    /// Ring to stop (a synthetic GET_VRING_BASE, its reply is swallowed).
    pub index: u8,
    /// Hand the library the ring's call fd again afterwards (GET_VRING_BASE
    /// makes it forget it, and the frontend will not send it again).
    pub recall: bool,
}

/// Follows the ring life cycle of one connection so that a ring the frontend
/// sets up again is stopped in the library first.
///
/// The library (`vhost-user-backend`) only starts a ring on the transition
/// "not ready -> kick fd set" and only stops it on GET_VRING_BASE. User-Mode
/// Linux never sends GET_VRING_BASE: when the guest driver is removed and
/// probed again (`unbind`/`bind`, a driver reset) it just sends SET_FEATURES,
/// SET_MEM_TABLE and CALL/NUM/BASE/ADDR/KICK for every ring again. The
/// library would keep the old ring running, never watch the new kick fd,
/// and the new driver would wait forever for its buffers (e.g. the free page
/// reporting worker, which blocks power-off). So:
///
/// * SET_VRING_NUM, SET_VRING_BASE or SET_VRING_KICK for a ring that was
///   started (kick fd given) since its last stop first stops that ring, then
///   hands the library the latest call fd again (GET_VRING_BASE drops it);
///   CALL and ADDR alone do not stop a ring (frontends change them on running
///   rings);
/// * GET_FEATURES while rings run and `VHOST_USER_F_PROTOCOL_FEATURES` is
///   not negotiated (so the frontend has no SET_VRING_ENABLE) stops all
///   rings: that is how UML's `vu_del_vqs()` ends ("ensure previous messages
///   have been processed") before the guest frees the rings. Without it the
///   device could still write to freed ring memory (e.g. hand back the held
///   stats buffer).
#[derive(Debug, Default)]
pub struct RingTracker {
    started: u64,
    call: Vec<Option<OwnedFd>>,
    protocol_acked: bool,
}

fn payload_u32(p: &[u8]) -> Option<u32> {
    payload_u32_at(p, 0)
}

fn payload_u32_at(p: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(p.get(off..off + 4)?.try_into().ok()?))
}

fn payload_u64(p: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(p.get(..8)?.try_into().ok()?))
}

impl RingTracker {
    /// Whether any ring runs (between its kick and GET_VRING_BASE).
    pub fn any_started(&self) -> bool {
        self.started != 0
    }

    fn is_started(&self, i: u8) -> bool {
        usize::from(i) < MAX_RINGS && self.started & (1u64 << i) != 0
    }

    fn stop(&mut self, i: u8, recall: bool, out: &mut Vec<RingStop>) {
        if self.is_started(i) {
            self.started &= !(1u64 << i);
            out.push(RingStop { index: i, recall });
        }
    }

    /// The call fd the library last got for ring `i` (for `recall`).
    pub fn call_fd(&self, i: u8) -> Option<&OwnedFd> {
        self.call.get(usize::from(i)).and_then(Option::as_ref)
    }

    fn set_call(&mut self, i: u8, fd: Option<OwnedFd>) {
        let i = usize::from(i);
        if i < MAX_RINGS {
            if self.call.len() <= i {
                self.call.resize_with(i + 1, || None);
            }
            self.call[i] = fd;
        }
    }

    /// Updates the state for one frontend message (`payload` without the
    /// header, `fds` as received) and returns the rings to stop first.
    pub fn before_forward(
        &mut self,
        request: u32,
        payload: &[u8],
        fds: &[OwnedFd],
    ) -> Vec<RingStop> {
        let mut out = Vec::new();
        match request {
            REQ_SET_FEATURES => {
                if let Some(v) = payload_u64(payload) {
                    self.protocol_acked = v & F_PROTOCOL_FEATURES != 0;
                }
            }
            REQ_GET_FEATURES if self.started != 0 && !self.protocol_acked => {
                // Keep the call fds in the library: UML still polls their
                // read ends until it frees the rings, and closing the write
                // ends would show it an EOF ("read returned 0" warnings).
                for i in 0..MAX_RINGS as u8 {
                    self.stop(i, true, &mut out);
                }
            }
            // Not SET_VRING_ADDR and SET_VRING_CALL: QEMU-style frontends
            // legitimately send those to a running ring (dirty logging,
            // notifier masking). A ring set up again always gets NUM and
            // BASE first.
            REQ_SET_VRING_NUM | REQ_SET_VRING_BASE => {
                if let Some(i) = payload_u32(payload).and_then(|i| u8::try_from(i).ok()) {
                    self.stop(i, true, &mut out);
                }
            }
            REQ_GET_VRING_BASE => {
                if let Some(i) = payload_u32(payload).and_then(|i| u8::try_from(i).ok()) {
                    if self.is_started(i) {
                        self.started &= !(1u64 << i);
                    }
                    self.set_call(i, None);
                }
            }
            REQ_SET_VRING_CALL | REQ_SET_VRING_KICK => {
                let Some(v) = payload_u64(payload) else {
                    return out;
                };
                let i = (v & 0xff) as u8;
                let has_fd = v & VRING_NOFD_MASK == 0 && fds.len() == 1;
                if request == REQ_SET_VRING_CALL {
                    self.set_call(
                        i,
                        if has_fd {
                            fds[0].try_clone().ok()
                        } else {
                            None
                        },
                    );
                } else {
                    self.stop(i, true, &mut out);
                    if has_fd && usize::from(i) < MAX_RINGS {
                        self.started |= 1u64 << i;
                    }
                }
            }
            _ => {}
        }
        out
    }
}

/// Replies of GET_VRING_BASE in flight, in order: `true` for those the shim
/// asked for itself (to be swallowed).
type ReplyQueue = Arc<Mutex<VecDeque<bool>>>;

fn vring_state_msg(request: u32, index: u32, num: u32) -> Vec<u8> {
    let mut m = Header {
        request,
        flags: FLAG_VERSION,
        size: 8,
    }
    .to_bytes()
    .to_vec();
    m.extend_from_slice(&index.to_le_bytes());
    m.extend_from_slice(&num.to_le_bytes());
    m
}

/// Stops ring `stop.index` in the library (and gives it the call fd again).
/// `n` counts the stops of this connection (for [`log_sparse`]).
fn stop_ring(
    back: &UnixStream,
    tracker: &RingTracker,
    replies: &ReplyQueue,
    stop: &RingStop,
    why: &str,
    n: u64,
) -> io::Result<()> {
    log_sparse(
        Level::Info,
        n,
        format_args!("stopping ring {} (frontend {why})", stop.index),
    );
    replies
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push_back(true);
    send_all(
        back,
        &vring_state_msg(REQ_GET_VRING_BASE, u32::from(stop.index), 0),
        &[],
    )?;
    if stop.recall {
        if let Some(fd) = tracker.call_fd(stop.index) {
            let mut m = Header {
                request: REQ_SET_VRING_CALL,
                flags: FLAG_VERSION,
                size: 8,
            }
            .to_bytes()
            .to_vec();
            m.extend_from_slice(&u64::from(stop.index).to_le_bytes());
            send_all(back, &m, &[fd.as_raw_fd()])?;
        }
    }
    Ok(())
}

/// Parsed vhost-user message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Request code.
    pub request: u32,
    /// Flags.
    pub flags: u32,
    /// Payload size.
    pub size: u32,
}

impl Header {
    /// Parses 12 header bytes.
    pub fn parse(b: &[u8; HDR_SIZE]) -> Self {
        let rd = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Self {
            request: rd(0),
            flags: rd(4),
            size: rd(8),
        }
    }

    /// Serialises the header.
    pub fn to_bytes(self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..4].copy_from_slice(&self.request.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.size.to_le_bytes());
        b
    }
}

fn sys_err(e: vmm_sys_util::errno::Error) -> io::Error {
    io::Error::from_raw_os_error(e.errno())
}

/// Receives exactly `buf.len()` bytes, collecting any passed fds. Returns
/// `Ok(false)` on a clean EOF before the first byte.
fn recv_exact(sock: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        let rest = &mut buf[got..];
        let mut iov = [libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        }];
        let mut raw: [RawFd; MAX_FDS] = [-1; MAX_FDS];
        // SAFETY: the iovec points into `buf`, which outlives the call.
        let res = unsafe { sock.recv_with_fds(&mut iov, &mut raw) };
        let (n, nfds) = match res {
            Ok(v) => v,
            Err(e) if e.errno() == libc::EINTR => continue,
            Err(e) => return Err(sys_err(e)),
        };
        for &fd in raw.iter().take(nfds) {
            // SAFETY: the kernel just installed these fds for us; we own them.
            fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        if n == 0 {
            if got == 0 {
                return Ok(false);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(true)
}

/// Sends all of `data`, attaching `fds` to the first chunk.
fn send_all(sock: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut sent = 0;
    let mut fds = fds;
    while sent < data.len() {
        match sock.send_with_fds(&[&data[sent..]], fds) {
            Ok(n) => {
                sent += n;
                fds = &[];
            }
            Err(e) if e.errno() == libc::EINTR => continue,
            Err(e) => return Err(sys_err(e)),
        }
    }
    Ok(())
}

fn is_socket(fd: &OwnedFd) -> bool {
    let Ok(dup) = fd.try_clone() else {
        return false;
    };
    File::from(dup)
        .metadata()
        .map(|m| m.file_type().is_socket())
        .unwrap_or(false)
}

/// The frontend's backend request channel (a socket, or a pipe on UML).
/// Messages are written with plain `write()` and never ask for a reply.
///
/// The fd is non-blocking: a frontend that stops reading its channel must
/// not hang the thread that sends (the control socket's, for `set_target`).
/// A message that does not fit at all fails with `WouldBlock` and nothing
/// is written; a message that fits in part waits up to
/// [`PARTIAL_WRITE_TIMEOUT`] for the rest, and if the frontend does not take
/// it the channel is marked broken (the stream is out of step) and every
/// later send fails.
#[derive(Debug)]
pub struct BackendChannel {
    state: Mutex<ChannelState>,
}

#[derive(Debug)]
struct ChannelState {
    file: File,
    broken: bool,
}

/// Sets `O_NONBLOCK` on `fd` (the frontend passed us its own end and
/// closed it, as QEMU and UML do).
fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl on a valid fd we own.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Waits until `file` is writable or `deadline` passed; true if writable.
fn wait_writable(file: &File, deadline: Instant) -> bool {
    let left = deadline.saturating_duration_since(Instant::now());
    let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
    let mut pfd = libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    rc > 0 && pfd.revents & libc::POLLOUT != 0
}

impl BackendChannel {
    /// Wraps the fd received in SET_BACKEND_REQ_FD.
    pub fn new(fd: OwnedFd) -> Self {
        if let Err(e) = set_nonblocking(&fd) {
            warn!("backend request channel stays blocking: {e}");
        }
        Self {
            state: Mutex::new(ChannelState {
                file: File::from(fd),
                broken: false,
            }),
        }
    }

    /// Writes one message (header flags: NEED_REPLY cleared). Never blocks
    /// for longer than [`PARTIAL_WRITE_TIMEOUT`] (see the type).
    pub fn send(&self, mut hdr: Header, payload: &[u8]) -> io::Result<()> {
        hdr.flags = (hdr.flags | FLAG_VERSION) & !FLAG_NEED_REPLY;
        let mut msg = hdr.to_bytes().to_vec();
        msg.extend_from_slice(payload);
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.broken {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "backend request channel out of step after a partial message",
            ));
        }
        let deadline = Instant::now() + PARTIAL_WRITE_TIMEOUT;
        let mut off = 0;
        while off < msg.len() {
            match st.file.write(&msg[off..]) {
                Ok(0) => {
                    st.broken = off > 0;
                    return Err(io::ErrorKind::WriteZero.into());
                }
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && off == 0 => {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        "backend request channel full: the frontend does not read it",
                    ));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !wait_writable(&st.file, deadline) {
                        st.broken = true;
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the frontend stopped reading its backend request channel \
                             in the middle of a message",
                        ));
                    }
                }
                Err(e) => {
                    st.broken = off > 0;
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG.
    pub fn send_config_change(&self) -> io::Result<()> {
        self.send(
            Header {
                request: BACKEND_CONFIG_CHANGE_MSG,
                flags: FLAG_VERSION,
                size: 0,
            },
            &[],
        )
    }
}

/// Bridges backend requests from the library (socket `ours`) to the real
/// channel, acknowledging locally when the library wants a reply.
fn bridge_backend_requests(mut ours: UnixStream, chan: Arc<BackendChannel>) {
    loop {
        let mut h = [0u8; HDR_SIZE];
        if ours.read_exact(&mut h).is_err() {
            return;
        }
        let hdr = Header::parse(&h);
        let Ok(size) = usize::try_from(hdr.size) else {
            return;
        };
        if size > MAX_PAYLOAD {
            return;
        }
        let mut payload = vec![0u8; size];
        if ours.read_exact(&mut payload).is_err() {
            return;
        }
        let res = chan.send(hdr, &payload);
        debug!("backend request {} bridged: {res:?}", hdr.request);
        if hdr.flags & FLAG_NEED_REPLY != 0 {
            let reply = Header {
                request: hdr.request,
                flags: FLAG_VERSION | FLAG_REPLY,
                size: 8,
            };
            let mut r = reply.to_bytes().to_vec();
            r.extend_from_slice(&u64::from(res.is_err()).to_le_bytes());
            if ours.write_all(&r).is_err() {
                return;
            }
        }
        if res.is_err() {
            return;
        }
    }
}

/// Callbacks from the shim into the device.
pub struct Hooks {
    /// SET_PROTOCOL_FEATURES value.
    pub on_protocol_features: Box<dyn Fn(u64) + Send>,
    /// SET_BACKEND_REQ_FD channel.
    pub on_backend_channel: Box<dyn Fn(Arc<BackendChannel>) + Send>,
    /// SET_CONFIG of a migration (offset, bytes): the configuration space
    /// the source's device had, device-owned fields included.
    pub on_migrated_config: ConfigHook,
}

/// Sees the (offset, bytes) of a migration's SET_CONFIG.
pub type ConfigHook = Box<dyn Fn(u32, &[u8]) + Send>;

/// The (offset, bytes) of a SET_CONFIG payload whose flags say it comes
/// from a migration; None for any other message or a malformed one (the
/// library refuses those).
pub fn migrated_config(request: u32, payload: &[u8]) -> Option<(u32, &[u8])> {
    if request != REQ_SET_CONFIG {
        return None;
    }
    let offset = payload_u32(payload)?;
    let size = usize::try_from(payload_u32_at(payload, 4)?).ok()?;
    let flags = payload_u32_at(payload, 8)?;
    let bytes = payload.get(CONFIG_HDR..)?;
    (flags == CONFIG_FLAGS_MIGRATION && bytes.len() == size).then_some((offset, bytes))
}

/// A received message: its header, the whole message bytes, the fds it carried.
type Message = (Header, Vec<u8>, Vec<OwnedFd>);

/// One whole vhost-user message, or None when the peer closed the
/// connection between messages.
fn recv_message(sock: &UnixStream) -> Result<Option<Message>, ShimError> {
    let mut fds = Vec::new();
    let mut h = [0u8; HDR_SIZE];
    if !recv_exact(sock, &mut h, &mut fds)? {
        return Ok(None);
    }
    let hdr = Header::parse(&h);
    let size = usize::try_from(hdr.size).unwrap_or(usize::MAX);
    if size > MAX_PAYLOAD {
        return Err(ShimError::TooLarge(hdr.size));
    }
    let mut msg = h.to_vec();
    msg.resize(HDR_SIZE + size, 0);
    if size > 0 && !recv_exact(sock, &mut msg[HDR_SIZE..], &mut fds)? {
        return Err(ShimError::Io(io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Some((hdr, msg, fds)))
}

/// Serialises writes to the frontend socket: the library's replies (relayed)
/// and the shim's own NACKs.
type FrontLock = Arc<Mutex<()>>;

/// Answers a refused message with a NACK when the frontend asked for an
/// ack (REPLY_ACK negotiated and NEED_REPLY set).
fn nack(front: &UnixStream, lock: &FrontLock, hdr: Header, reply_ack: bool) {
    if !(reply_ack && hdr.flags & FLAG_NEED_REPLY != 0) {
        return;
    }
    let mut m = Header {
        request: hdr.request,
        flags: FLAG_VERSION | FLAG_REPLY,
        size: 8,
    }
    .to_bytes()
    .to_vec();
    m.extend_from_slice(&1u64.to_le_bytes());
    let _g = lock.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = send_all(front, &m, &[]) {
        debug!("NACK to request {}: {e}", hdr.request);
    }
}

/// Relays frontend -> library, message by message.
fn frontend_to_backend(
    front: &UnixStream,
    back: &UnixStream,
    hooks: &Hooks,
    replies: &ReplyQueue,
    front_lock: &FrontLock,
) -> Result<(), ShimError> {
    let mut rings = RingTracker::default();
    let mut protocol = 0u64;
    let (mut stops, mut channels) = (0u64, 0u64);
    loop {
        let Some((hdr, mut msg, mut fds)) = recv_message(front)? else {
            return Ok(());
        };
        let size = msg.len() - HDR_SIZE;
        debug!(
            "frontend request {} flags {:#x} size {} fds {} payload {:02x?}",
            hdr.request,
            hdr.flags,
            hdr.size,
            fds.len(),
            &msg[HDR_SIZE..HDR_SIZE + size.min(48)]
        );
        let cut = normalize_mem_table(&mut msg);
        if cut > 0 {
            debug!("SET_MEM_TABLE: dropped {cut} bytes of unused region slots");
        }
        if let Err(e) = check_request(hdr.request, &msg[HDR_SIZE..], &fds) {
            nack(front, front_lock, hdr, protocol & PROTOCOL_F_REPLY_ACK != 0);
            return Err(e);
        }
        let why = if hdr.request == REQ_GET_FEATURES {
            "tears the rings down"
        } else {
            "sets the ring up again"
        };
        for stop in rings.before_forward(hdr.request, &msg[HDR_SIZE..], &fds) {
            stops += 1;
            stop_ring(back, &rings, replies, &stop, why, stops)?;
        }
        if hdr.request == REQ_GET_VRING_BASE {
            replies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(false);
        }
        if hdr.request == REQ_SET_PROTOCOL_FEATURES && size == 8 {
            let mut v = [0u8; 8];
            v.copy_from_slice(&msg[HDR_SIZE..]);
            protocol = u64::from_le_bytes(v);
            (hooks.on_protocol_features)(protocol);
        }
        if hdr.request == REQ_SET_BACKEND_REQ_FD && fds.len() == 1 {
            channels += 1;
            let kind = if is_socket(&fds[0]) {
                "a socket"
            } else {
                "a pipe (User-Mode Linux): no replies will be requested"
            };
            log_sparse(
                Level::Info,
                channels,
                format_args!("backend request channel is {kind}"),
            );
            let chan = Arc::new(BackendChannel::new(fds.remove(0)));
            let (ours, theirs) = UnixStream::pair()?;
            let c2 = chan.clone();
            thread::Builder::new()
                .name("backend-req-bridge".into())
                .spawn(move || bridge_backend_requests(ours, c2))
                .map_err(ShimError::Spawn)?;
            fds.push(OwnedFd::from(theirs));
            (hooks.on_backend_channel)(chan);
        }
        // A migration restores the configuration before the device starts;
        // the `vhost` crate's own frontend sends 1 for ordinary writes, which
        // come with the rings running, and stay driver writes.
        if !rings.any_started() {
            if let Some((offset, bytes)) = migrated_config(hdr.request, &msg[HDR_SIZE..]) {
                (hooks.on_migrated_config)(offset, bytes);
            }
        }
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        send_all(back, &msg, &raw)?;
        // our copies of the fds are closed here; the library has its own
    }
}

/// Relays library -> frontend message by message (with any fds), dropping
/// the replies to the shim's own GET_VRING_BASE requests.
fn backend_to_frontend(
    back: &UnixStream,
    front: &UnixStream,
    replies: &ReplyQueue,
    front_lock: &FrontLock,
) -> Result<(), ShimError> {
    loop {
        let Some((hdr, msg, fds)) = recv_message(back)? else {
            return Ok(());
        };
        if hdr.request == REQ_GET_VRING_BASE && hdr.flags & FLAG_REPLY != 0 {
            let ours = replies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front()
                .unwrap_or(false);
            if ours {
                debug!(
                    "swallowed reply to our GET_VRING_BASE: {:02x?}",
                    &msg[HDR_SIZE..]
                );
                continue;
            }
        }
        debug!(
            "to frontend: request {} flags {:#x} size {}",
            hdr.request, hdr.flags, hdr.size
        );
        let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let _g = front_lock.lock().unwrap_or_else(|p| p.into_inner());
        send_all(front, &msg, &raw)?;
    }
}

/// Running shim of one connection.
pub struct Shim {
    threads: Vec<JoinHandle<()>>,
}

impl Shim {
    /// Starts relaying between `front` (the frontend) and `back` (the
    /// library's end). `on_proto` sees SET_PROTOCOL_FEATURES values.
    pub fn spawn(front: UnixStream, back: UnixStream, hooks: Hooks) -> Result<Self, ShimError> {
        let (f1, b1) = (front.try_clone()?, back.try_clone()?);
        let replies: ReplyQueue = Arc::default();
        let r2 = replies.clone();
        let front_lock: FrontLock = Arc::default();
        let l2 = front_lock.clone();
        let t1 = thread::Builder::new()
            .name("shim-f2b".into())
            .spawn(move || {
                if let Err(e) = frontend_to_backend(&f1, &b1, &hooks, &replies, &front_lock) {
                    warn!("frontend connection: {e}");
                }
                let _ = b1.shutdown(Shutdown::Both);
                let _ = f1.shutdown(Shutdown::Both);
            })
            .map_err(ShimError::Spawn)?;
        let t2 = thread::Builder::new()
            .name("shim-b2f".into())
            .spawn(move || {
                if let Err(e) = backend_to_frontend(&back, &front, &r2, &l2) {
                    debug!("backend side: {e}");
                }
                let _ = front.shutdown(Shutdown::Both);
                let _ = back.shutdown(Shutdown::Both);
            })
            .map_err(ShimError::Spawn)?;
        Ok(Self {
            threads: vec![t1, t2],
        })
    }

    /// Waits for both relay threads.
    pub fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_roundtrip() {
        let h = Header {
            request: 21,
            flags: 9,
            size: 8,
        };
        assert_eq!(Header::parse(&h.to_bytes()), h);
    }

    fn mem_table_msg(num: u32, slots: usize) -> Vec<u8> {
        let size = MEM_TABLE_HDR + slots * MEM_REGION_SIZE;
        let mut m = Header {
            request: REQ_SET_MEM_TABLE,
            flags: FLAG_VERSION | FLAG_NEED_REPLY,
            size: u32::try_from(size).unwrap(),
        }
        .to_bytes()
        .to_vec();
        m.extend_from_slice(&num.to_le_bytes());
        m.extend_from_slice(&[0; 4]);
        for i in 0..slots {
            let v = u8::try_from(i + 1).unwrap();
            m.extend_from_slice(&[v; MEM_REGION_SIZE]);
        }
        m
    }

    fn hdr_of(m: &[u8]) -> Header {
        let mut h = [0u8; HDR_SIZE];
        h.copy_from_slice(&m[..HDR_SIZE]);
        Header::parse(&h)
    }

    #[test]
    fn uml_mem_table_is_trimmed_to_used_regions() {
        // UML: num = 1 in a 2-slot (72 byte) payload
        let mut m = mem_table_msg(1, 2);
        assert_eq!(normalize_mem_table(&mut m), MEM_REGION_SIZE);
        assert_eq!(m.len(), HDR_SIZE + MEM_TABLE_HDR + MEM_REGION_SIZE);
        let h = hdr_of(&m);
        assert_eq!(h.size, 40);
        assert_eq!(h.flags, FLAG_VERSION | FLAG_NEED_REPLY);
        assert_eq!(&m[HDR_SIZE + MEM_TABLE_HDR..], &[1u8; MEM_REGION_SIZE]);
    }

    #[test]
    fn exact_or_broken_mem_tables_are_left_alone() {
        for (num, slots) in [(2, 2), (1, 1), (3, 2), (0, 2), (u32::MAX, 1)] {
            let mut m = mem_table_msg(num, slots);
            let orig = m.clone();
            assert_eq!(normalize_mem_table(&mut m), 0, "num {num} slots {slots}");
            assert_eq!(m, orig);
        }
        let mut other = mem_table_msg(1, 2);
        other[0] = 6;
        assert_eq!(normalize_mem_table(&mut other), 0);
        let mut short = mem_table_msg(1, 0);
        short.truncate(HDR_SIZE + 4);
        assert_eq!(normalize_mem_table(&mut short), 0);
    }

    fn eventfd() -> OwnedFd {
        // SAFETY: plain syscall; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh fd we own.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    fn ring_u64(i: u64) -> Vec<u8> {
        i.to_le_bytes().to_vec()
    }

    fn ring_state(i: u32) -> Vec<u8> {
        let mut v = i.to_le_bytes().to_vec();
        v.extend_from_slice(&0u32.to_le_bytes());
        v
    }

    /// UML's vu_find_vqs(): CALL, NUM, BASE, ADDR per ring, then KICK each.
    fn uml_setup(t: &mut RingTracker, rings: u8) -> Vec<RingStop> {
        let mut stops = Vec::new();
        for i in 0..rings {
            stops.extend(t.before_forward(REQ_SET_VRING_CALL, &ring_u64(i.into()), &[eventfd()]));
            for req in [REQ_SET_VRING_NUM, REQ_SET_VRING_BASE, REQ_SET_VRING_ADDR] {
                stops.extend(t.before_forward(req, &ring_state(i.into()), &[]));
            }
        }
        for i in 0..rings {
            stops.extend(t.before_forward(REQ_SET_VRING_KICK, &ring_u64(i.into()), &[eventfd()]));
        }
        stops
    }

    #[test]
    fn first_setup_stops_nothing() {
        let mut t = RingTracker::default();
        t.before_forward(REQ_SET_FEATURES, &ring_u64(1 << 30), &[]);
        assert!(uml_setup(&mut t, 4).is_empty());
        assert!(t.call_fd(3).is_some());
        // with PROTOCOL_FEATURES the frontend can disable rings itself:
        // GET_FEATURES is just a query
        assert!(t.before_forward(REQ_GET_FEATURES, &[], &[]).is_empty());
    }

    #[test]
    fn uml_reprobe_stops_each_ring_before_it_is_set_up_again() {
        let mut t = RingTracker::default();
        t.before_forward(REQ_SET_FEATURES, &ring_u64(0x1_0000_0027), &[]);
        uml_setup(&mut t, 4);
        let stops = uml_setup(&mut t, 4);
        let want: Vec<RingStop> = (0..4)
            .map(|index| RingStop {
                index,
                recall: true,
            })
            .collect();
        assert_eq!(stops, want);
    }

    #[test]
    fn uml_teardown_get_features_stops_all_rings_keeping_call_fds() {
        let mut t = RingTracker::default();
        t.before_forward(REQ_SET_FEATURES, &ring_u64(0x1_0000_0027), &[]);
        uml_setup(&mut t, 3);
        let stops = t.before_forward(REQ_GET_FEATURES, &[], &[]);
        assert_eq!(stops.len(), 3);
        assert!(stops.iter().all(|s| s.recall));
        assert!(t.call_fd(0).is_some());
        // nothing runs any more: a second GET_FEATURES and the new setup are quiet
        assert!(t.before_forward(REQ_GET_FEATURES, &[], &[]).is_empty());
        assert!(uml_setup(&mut t, 3).is_empty());
    }

    #[test]
    fn new_kick_or_base_on_a_running_ring_stops_it_and_recalls() {
        let mut t = RingTracker::default();
        uml_setup(&mut t, 2);
        // a new call fd or ring address alone keeps the ring running
        let call = t.before_forward(REQ_SET_VRING_CALL, &ring_u64(1), &[eventfd()]);
        assert!(call.is_empty());
        assert!(t
            .before_forward(REQ_SET_VRING_ADDR, &ring_state(1), &[])
            .is_empty());
        let s = t.before_forward(REQ_SET_VRING_BASE, &ring_state(1), &[]);
        assert_eq!(
            s,
            vec![RingStop {
                index: 1,
                recall: true
            }]
        );
        let s = t.before_forward(REQ_SET_VRING_KICK, &ring_u64(0), &[eventfd()]);
        assert_eq!(
            s,
            vec![RingStop {
                index: 0,
                recall: true
            }]
        );
        // ring 0 runs again (new kick), ring 1 waits for its kick
        assert_eq!(
            t.before_forward(REQ_SET_VRING_NUM, &ring_state(1), &[]),
            vec![]
        );
    }

    #[test]
    fn frontend_get_vring_base_stops_tracking_and_no_fd_kick_does_not_start() {
        let mut t = RingTracker::default();
        uml_setup(&mut t, 1);
        assert!(t
            .before_forward(REQ_GET_VRING_BASE, &ring_state(0), &[])
            .is_empty());
        assert!(t.call_fd(0).is_none());
        assert!(uml_setup(&mut t, 1).is_empty());
        // a kick without fd (polling) does not start the ring in the library
        let mut t = RingTracker::default();
        t.before_forward(REQ_SET_VRING_KICK, &ring_u64(0x100), &[]);
        assert!(t
            .before_forward(REQ_SET_VRING_NUM, &ring_state(0), &[])
            .is_empty());
        // garbage payloads and huge indexes are ignored
        assert!(t.before_forward(REQ_SET_VRING_NUM, &[1, 2], &[]).is_empty());
        assert!(t
            .before_forward(REQ_GET_VRING_BASE, &ring_state(300), &[])
            .is_empty());
        assert!(t
            .before_forward(REQ_SET_VRING_KICK, &ring_u64(200), &[eventfd()])
            .is_empty());
        assert!(t
            .before_forward(REQ_SET_VRING_NUM, &ring_state(200), &[])
            .is_empty());
    }

    fn sealed_memfd(size: u64) -> OwnedFd {
        let name = std::ffi::CString::new("shim-test").unwrap();
        // SAFETY: valid C string; we own the returned fd.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(fd >= 0);
        // SAFETY: fresh fd owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        // SAFETY: fcntl on a valid fd.
        assert_eq!(
            unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) },
            0
        );
        OwnedFd::from(f)
    }

    fn mem_table_payload(regions: &[(u64, u64)]) -> Vec<u8> {
        let mut p = u32::try_from(regions.len()).unwrap().to_le_bytes().to_vec();
        p.extend_from_slice(&[0; 4]);
        for &(size, offset) in regions {
            for v in [0x4000_0000u64, size, 0x7000_0000_0000, offset] {
                p.extend_from_slice(&v.to_le_bytes());
            }
        }
        p
    }

    #[test]
    fn only_a_well_formed_migration_set_config_is_taken() {
        let msg = |offset: u32, size: u32, flags: u32, bytes: &[u8]| {
            let mut p = offset.to_le_bytes().to_vec();
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&flags.to_le_bytes());
            p.extend_from_slice(bytes);
            p
        };
        let cfg = [7u8; 16];
        let p = msg(0, 16, CONFIG_FLAGS_MIGRATION, &cfg);
        assert_eq!(migrated_config(REQ_SET_CONFIG, &p), Some((0, &cfg[..])));
        // a driver's write, another request, a size that does not match
        assert_eq!(migrated_config(REQ_SET_CONFIG, &msg(0, 16, 0, &cfg)), None);
        assert_eq!(migrated_config(REQ_SET_FEATURES, &p), None);
        assert_eq!(migrated_config(REQ_SET_CONFIG, &msg(0, 17, 1, &cfg)), None);
        assert_eq!(migrated_config(REQ_SET_CONFIG, &p[..8]), None);
    }

    #[test]
    fn mem_table_regions_must_lie_inside_their_files() {
        let fd = || sealed_memfd(1 << 20);
        let ok = mem_table_payload(&[(1 << 20, 0)]);
        assert!(check_request(REQ_SET_MEM_TABLE, &ok, &[fd()]).is_ok());
        let past = mem_table_payload(&[(1 << 40, 0)]);
        let e = check_request(REQ_SET_MEM_TABLE, &past, &[fd()]).unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
        // the second region is the bad one
        let two = mem_table_payload(&[(4096, 0), (4096, 1 << 20)]);
        let e = check_request(REQ_SET_MEM_TABLE, &two, &[fd(), fd()]).unwrap_err();
        assert!(e.to_string().contains("memory region 1"), "{e}");
        // one fd per region
        let e = check_request(REQ_SET_MEM_TABLE, &ok, &[]).unwrap_err();
        assert!(
            matches!(e, ShimError::FdCount { regions: 1, fds: 0 }),
            "{e}"
        );
        // a truncated payload is the library's to refuse
        assert!(check_request(REQ_SET_MEM_TABLE, &ok[..20], &[fd()]).is_ok());
    }

    #[test]
    fn dirty_log_must_lie_inside_its_file() {
        let mut p = (8192u64).to_le_bytes().to_vec();
        p.extend_from_slice(&0u64.to_le_bytes());
        let e = check_request(REQ_SET_LOG_BASE, &p, &[sealed_memfd(4096)]).unwrap_err();
        assert!(e.to_string().contains("dirty log"), "{e}");
        assert!(check_request(REQ_SET_LOG_BASE, &p, &[sealed_memfd(8192)]).is_ok());
    }

    #[test]
    fn ring_sizes_are_powers_of_two() {
        for (num, ok) in [(1, true), (256, true), (1024, true), (0, false), (3, false)] {
            let p = ring_state(0)
                .into_iter()
                .take(4)
                .chain(u32::to_le_bytes(num))
                .collect::<Vec<u8>>();
            assert_eq!(
                check_request(REQ_SET_VRING_NUM, &p, &[]).is_ok(),
                ok,
                "{num}"
            );
        }
    }

    #[test]
    fn a_full_backend_channel_does_not_block() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let chan = BackendChannel::new(OwnedFd::from(theirs));
        let t = std::time::Instant::now();
        let mut sent = 0;
        let err = loop {
            match chan.send_config_change() {
                Ok(()) => sent += 1,
                Err(e) => break e,
            }
            assert!(sent < 1_000_000, "the channel never filled up");
        };
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // nothing half written: the reader sees whole messages only, and
        // once it reads, sending works again
        let mut r = ours;
        r.set_nonblocking(true).unwrap();
        let mut buf = vec![0u8; HDR_SIZE * (sent + 1)];
        let mut got = 0;
        while let Ok(n) = r.read(&mut buf[got..]) {
            if n == 0 {
                break;
            }
            got += n;
        }
        assert_eq!(got, HDR_SIZE * sent);
        assert!(chan.send_config_change().is_ok());
    }

    #[test]
    fn pipe_bridge_acks_and_strips_need_reply() {
        let (mut lib, ours) = UnixStream::pair().unwrap();
        let mut fds = [0; 2];
        // SAFETY: valid out array.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fresh fds we own.
        let (mut rd, wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let chan = Arc::new(BackendChannel::new(OwnedFd::from(wr)));
        let t = thread::spawn(move || bridge_backend_requests(ours, chan));
        let req = Header {
            request: 2,
            flags: FLAG_VERSION | FLAG_NEED_REPLY,
            size: 0,
        };
        lib.write_all(&req.to_bytes()).unwrap();
        let mut got = [0u8; HDR_SIZE];
        rd.read_exact(&mut got).unwrap();
        assert_eq!(
            Header::parse(&got),
            Header {
                request: 2,
                flags: FLAG_VERSION,
                size: 0
            }
        );
        let mut rep = [0u8; HDR_SIZE + 8];
        lib.read_exact(&mut rep).unwrap();
        let mut hb = [0u8; HDR_SIZE];
        hb.copy_from_slice(&rep[..HDR_SIZE]);
        assert_eq!(Header::parse(&hb).flags, FLAG_VERSION | FLAG_REPLY);
        assert_eq!(&rep[HDR_SIZE..], &[0u8; 8]);
        drop(lib);
        t.join().unwrap();
    }
}
