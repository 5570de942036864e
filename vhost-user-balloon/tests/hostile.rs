//! A hostile guest and a hostile frontend: each test starts the daemon
//! binary, feeds it what a well-behaved driver or frontend never sends, and
//! checks that the daemon stays up, stays quiet in its log, gives nothing
//! away it should not, and serves the next frontend.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::*;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::vhost_user::VhostUserFrontend;
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

fn pfn(gpa: u64) -> u32 {
    u32::try_from(gpa >> 12).unwrap()
}

/// Checks that the daemon still runs and serves a new frontend: a one-page
/// report is discarded and acknowledged.
fn serves_a_new_frontend(d: &mut Daemon) -> Result<(), String> {
    d.alive()?;
    // without PAGE_POISON: a poison_val an earlier guest left behind (it is
    // kept across reconnects) is cleared, and reported pages read zero
    let opts = Opts {
        clear_features: 1 << 4,
        ..Opts::default()
    };
    let mut g = Guest::try_connect_opts(d, None, &opts)
        .map_err(|e| format!("a new frontend was not served: {e}"))?;
    let page = GPA + 15 * MIB;
    g.fill(page, 4096, 0x5a);
    g.queues[REPORTING].push(&g.mem, &[(page, 4096, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING]
        .try_wait_used(&g.mem, 1, Duration::from_secs(10))
        .map_err(|e| format!("report of the new frontend: {e}"))?;
    if !g.read(page, 4096).iter().all(|&b| b == 0) {
        return Err("the new frontend's report was not discarded".into());
    }
    d.alive()
}

fn assert_serves_a_new_frontend(d: &mut Daemon) {
    if let Err(e) = serves_a_new_frontend(d) {
        panic!("{e}");
    }
}

/// Log lines written since `before`, with the first ones for the message.
fn assert_log_lines(d: &Daemon, before: usize, max: usize, what: &str) {
    let n = d.log_lines() - before;
    assert!(
        n <= max,
        "{n} log lines (at most {max} expected) for {what}; the first ones:\n{}",
        d.log_since(before, 8)
    );
}

/// A guest can send 65,536 PFNs in one inflate chain (the most the device
/// reads) and 16 ranges in one report, all outside its RAM: the daemon logs
/// a summary per chain, not a line per range.
#[test]
fn a_chain_of_bad_pfns_is_logged_in_a_few_lines() {
    let d = start_daemon_logged("logflood", &[]);
    let mut g = Guest::connect(&d, None);
    let before = d.log_lines();
    let arr = GPA + 2 * MIB;
    let n = 65_536u32;
    let pfns: Vec<u8> = (0..n)
        .flat_map(|i| (0x10_0000 + 2 * i).to_le_bytes())
        .collect();
    g.mem.write_slice(&pfns, GuestAddress(arr)).unwrap();
    let bitmap = arr + pfns.len() as u64;
    g.queues[INFLATE].push(
        &g.mem,
        &[(arr, pfns.len() as u32, false), (bitmap, n / 8, true)],
    );
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    let bad: Vec<(u64, u32, bool)> = (0..16u64).map(|i| (i << 40, 4096, true)).collect();
    g.queues[REPORTING].push(&g.mem, &bad);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    let c = wait_counters(&d, |c| {
        c["counters"]["rejects"]["outside_memory"] == u64::from(n) + 16
    });
    assert_eq!(c["counters"]["reports_not_initialized"], 1, "{c}");
    assert_log_lines(
        &d,
        before,
        4,
        "an inflate chain of 65536 bad PFNs and a report of 16 bad ranges",
    );
}

/// With LOG_ALL negotiated and no log shared, every treated range is a
/// dirty-log miss: counted, not logged one by one.
#[test]
fn dirty_log_misses_are_logged_in_a_few_lines() {
    let d = start_daemon_logged("missflood", &[]);
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            log_all: true,
            ..Opts::default()
        },
    );
    let before = d.log_lines();
    // 1024 pages, none adjacent: 1024 ranges
    let arr = GPA + MIB;
    let pages: Vec<u64> = (0..1024u64).map(|i| GPA + 2 * MIB + 2 * 4096 * i).collect();
    let pfns: Vec<u8> = pages.iter().flat_map(|&p| pfn(p).to_le_bytes()).collect();
    g.mem.write_slice(&pfns, GuestAddress(arr)).unwrap();
    let bitmap = arr + pfns.len() as u64;
    g.queues[INFLATE].push(
        &g.mem,
        &[(arr, pfns.len() as u32, false), (bitmap, 1024 / 8, true)],
    );
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    assert!(
        g.read(bitmap, 128).iter().all(|&b| b == 0),
        "no page acknowledged without a dirty log"
    );
    let ranges: Vec<(u64, u32, bool)> = (0..16u64)
        .map(|i| (GPA + 11 * MIB + i * 2 * 4096, 4096, true))
        .collect();
    g.queues[REPORTING].push(&g.mem, &ranges);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    let c = wait_counters(&d, |c| c["counters"]["dirty_log_misses"] == 1024 + 16);
    assert_eq!(c["counters"]["reports_not_initialized"], 1, "{c}");
    assert_log_lines(&d, before, 4, "1040 ranges the dirty log missed");
}

/// SET_MEM_TABLE with a region of 1 TiB over a 1 MiB memfd: refused. (The
/// daemon used to take it and die of SIGBUS at the first ring access past
/// the end of the file.)
#[test]
fn a_memory_region_past_the_end_of_its_file_is_refused() {
    let mut d = start_daemon_logged("pasteof", &[]);
    let file = sealed_memfd(MIB, 0);
    let mut fe = frontend(&d).unwrap();
    fe.set_owner().unwrap();
    let f = fe.get_features().unwrap();
    fe.set_features(f & !LOG_ALL).unwrap();
    fe.set_protocol_features(
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::REPLY_ACK,
    )
    .unwrap();
    // user addresses are only names for the daemon; nothing is mapped there
    let uaddr = 0x7000_0000_0000u64;
    let res = fe
        .set_mem_table(&[VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: 1 << 40,
            userspace_addr: uaddr,
            mmap_offset: 0,
            mmap_handle: file.as_raw_fd(),
        }])
        // (no ack asked for: a round trip tells whether the daemon took it)
        .and_then(|_| fe.get_features());
    if res.is_ok() {
        // ring 0 at 2 MiB, past the end of the file
        let ring = uaddr + 2 * MIB;
        let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
        let _ = fe.set_vring_num(0, 16);
        let _ = fe.set_vring_addr(
            0,
            &VringConfigData {
                queue_max_size: 16,
                queue_size: 16,
                flags: 0,
                desc_table_addr: ring,
                avail_ring_addr: ring + 0x1000,
                used_ring_addr: ring + 0x2000,
                log_addr: None,
            },
        );
        let _ = fe.set_vring_base(0, 0);
        let _ = fe.set_vring_call(0, &call);
        let _ = fe.set_vring_kick(0, &kick);
        let _ = fe.set_vring_enable(0, true);
        let _ = kick.write(1);
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(fe);
    std::thread::sleep(Duration::from_millis(100));
    if let Err(e) = d.alive() {
        panic!(
            "{e} after a 1 TiB region over a 1 MiB memfd; log:\n{}",
            d.log_since(0, 30)
        );
    }
    assert!(
        res.is_err(),
        "SET_MEM_TABLE of 1 TiB over a 1 MiB file was accepted"
    );
    assert_serves_a_new_frontend(&mut d);
}

/// A memfd that is not sealed against shrinking is refused (the frontend
/// could truncate it under the daemon's mapping); a sealed one cannot be
/// truncated.
#[test]
fn an_unsealed_memfd_is_refused_and_a_sealed_one_cannot_shrink() {
    let mut d = start_daemon_logged("unsealed", &[]);
    let res = Guest::try_connect_opts(
        &d,
        None,
        &Opts {
            seal: false,
            ..Opts::default()
        },
    );
    let accepted = res.is_ok();
    if let Ok(g) = res {
        // the frontend truncates its memory under the daemon and kicks
        g.file.set_len(0).unwrap();
        g.kick(REPORTING);
        std::thread::sleep(Duration::from_millis(300));
        drop(g);
    }
    std::thread::sleep(Duration::from_millis(100));
    if let Err(e) = d.alive() {
        panic!(
            "{e} after the frontend truncated its unsealed memfd; log:\n{}",
            d.log_since(0, 30)
        );
    }
    assert!(!accepted, "an unsealed memfd was accepted as guest memory");
    // sealed: the frontend cannot shrink it any more
    let g = Guest::connect(&d, None);
    let err = g.file.set_len(0).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EPERM), "{err}");
    drop(g);
    assert_serves_a_new_frontend(&mut d);
}

/// User-Mode Linux shares its RAM as a regular file from an offset, with
/// no seals: accepted (the end of the region is inside the file).
#[test]
fn a_regular_file_like_umls_is_accepted() {
    let mut d = start_daemon_logged("umlfile", &[]);
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            regular_file_offset: Some(4 * MIB),
            ..Opts::default()
        },
    );
    let r = GPA + 4 * MIB;
    g.fill(r, MIB, 0xab);
    g.queues[REPORTING].push(&g.mem, &[(r, MIB as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), MIB as u32);
    assert!(g.read(r, MIB).iter().all(|&b| b == 0));
    drop(g);
    assert_serves_a_new_frontend(&mut d);
}

/// QEMU takes reported ranges from the device-writable buffers only
/// (`in_sg`); so does the device: a read-only descriptor is not a range.
#[test]
fn report_ranges_come_only_from_device_writable_descriptors() {
    let d = start_daemon_logged("readonly", &[]);
    let mut g = Guest::connect(&d, None);
    let (w, r) = (GPA + 4 * MIB, GPA + 6 * MIB);
    g.fill(w, 4 * MIB, 0xab);
    g.queues[REPORTING].push(&g.mem, &[(w, MIB as u32, true), (r, MIB as u32, false)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert!(
        g.read(r, MIB).iter().all(|&b| b == 0xab),
        "the range of a read-only descriptor was discarded"
    );
    assert_eq!(
        g.queues[REPORTING].used_len(&g.mem, 0),
        0,
        "a report with a read-only descriptor is not acknowledged as initialized"
    );
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["rejects"]["malformed"], 1, "{c}");
}

/// VIRTIO_RING_F_INDIRECT_DESC is not offered: a chain through an indirect
/// table is malformed, returned with used length 0, its ranges untouched.
#[test]
fn indirect_descriptors_are_refused() {
    let d = start_daemon_logged("indirect", &[]);
    let mut g = Guest::connect(&d, None);
    let r = GPA + 4 * MIB;
    g.fill(r, MIB, 0xab);
    let table = GPA + MIB;
    write_desc(&g.mem, table, 0, r, MIB as u32, DESC_WRITE, 0);
    let q = &mut g.queues[REPORTING];
    q.write_desc(&g.mem, 0, table, 16, DESC_INDIRECT, 0);
    q.post(&g.mem, 0);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert!(
        g.read(r, MIB).iter().all(|&b| b == 0xab),
        "a range behind an indirect descriptor was discarded"
    );
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), 0);
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["rejects"]["malformed"], 1, "{c}");
}

/// Split rings have a power-of-two size (virtio 1.2 2.7): SET_VRING_NUM 3
/// is refused.
#[test]
fn ring_sizes_must_be_a_power_of_two() {
    let mut d = start_daemon_logged("ringsize", &[]);
    let raw = RawFrontend::connect(&d).unwrap();
    raw.handshake(VhostUserProtocolFeatures::empty()).unwrap();
    let ack = raw.acked(req::SET_VRING_NUM, &vring_state(0, 3), &[]);
    assert!(
        !matches!(ack, Ok(0)),
        "SET_VRING_NUM 3 was accepted ({ack:?})"
    );
    assert!(raw.closed_within(Duration::from_secs(5)));
    drop(raw);
    assert_serves_a_new_frontend(&mut d);
}

/// A chain whose head index is past the end of the ring cannot be returned
/// to the guest; the chains popped with it still are.
#[test]
fn a_bad_head_does_not_lose_the_rest_of_its_batch() {
    let d = start_daemon_logged("badhead", &[]);
    let mut g = Guest::connect(&d, None);
    let arr = GPA + MIB;
    let page = GPA + 4 * MIB;
    g.mem.write_obj(pfn(page), GuestAddress(arr)).unwrap();
    g.queues[INFLATE].post(&g.mem, 5000);
    g.queues[INFLATE].push(&g.mem, &[(arr, 4, false), (arr + 64, 1, true)]);
    g.kick(INFLATE);
    let q = &g.queues[INFLATE];
    if let Err(e) = q.try_wait_used(&g.mem, 1, Duration::from_secs(5)) {
        panic!("the valid chain after head 5000 was never returned: {e}");
    }
    assert_eq!(
        q.used_elem(&g.mem, 0),
        (0, 1),
        "the valid chain, bitmap length"
    );
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(arr + 64)).unwrap(), 1);
}

/// A frontend that stops reading its backend request channel: every
/// set_target still gets its answer (the config change is not sent), and
/// the control socket keeps working.
#[test]
fn set_target_does_not_hang_when_the_frontend_stops_reading() {
    let d = start_daemon_logged("noreader", &[]);
    let (_ours, theirs) = UnixStream::pair().unwrap();
    let _g = Guest::connect(&d, Some(&theirs));
    drop(theirs);
    let s = UnixStream::connect(&d.ctl).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    let mut not_notified = 0;
    for i in 0..2000u32 {
        writeln!(w, r#"{{"cmd":"set_target","pages":{i}}}"#).unwrap();
        let mut line = String::new();
        if let Err(e) = r.read_line(&mut line) {
            panic!("set_target #{i}: no answer within 5 s ({e}): the control thread hangs");
        }
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if v["notified"] != true {
            not_notified += 1;
        }
    }
    assert!(not_notified > 0, "the channel never filled up");
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["target"], 1999, "{c}");
    assert_eq!(c["connected"], true, "{c}");
}

// ---------------------------------------------------------------------------
// The hostile-frontend suite: many cases against one daemon. After each
// case the daemon must still run, serve a new frontend (with timeouts on
// every read: a hang fails the case) and have written at most
// MAX_CASE_LOG_LINES log lines (default log level) for it.
// ---------------------------------------------------------------------------

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::time::Instant;

/// Most log lines one case may cost, the new frontend's included.
const MAX_CASE_LOG_LINES: usize = 100;

/// What the daemon did with a hostile input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// It NACKed the message and/or dropped the connection.
    Refused,
    /// It kept the connection and served (or ignored) the input.
    Handled,
}

type Res = Result<Outcome, String>;
type CaseFn = Box<dyn Fn(&Daemon) -> Res>;

fn case(name: &'static str, f: impl Fn(&Daemon) -> Res + 'static) -> (&'static str, CaseFn) {
    (name, Box::new(f))
}

fn err<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> String {
    move |e| format!("{what}: {e}")
}

fn raw(d: &Daemon) -> Result<RawFrontend, String> {
    RawFrontend::connect(d).map_err(err("connect"))
}

/// Refused when the daemon dropped the connection (soon), Handled otherwise.
fn ended(r: RawFrontend) -> Res {
    Ok(if r.closed_within(Duration::from_millis(200)) {
        Outcome::Refused
    } else {
        Outcome::Handled
    })
}

/// An ack of 0 is Handled (connection kept); a NACK, an error or a closed
/// connection is Refused.
fn by_ack(r: RawFrontend, ack: io::Result<u64>) -> Res {
    match ack {
        Ok(0) => ended(r),
        _ => Ok(Outcome::Refused),
    }
}

/// Handshake and a valid 16 MiB sealed memfd at [`GPA`].
fn ready(d: &Daemon, protocol: VhostUserProtocolFeatures) -> Result<(RawFrontend, File), String> {
    let r = raw(d)?;
    r.handshake(protocol).map_err(err("handshake"))?;
    let f = sealed_memfd(MEM, 0);
    let ack = r
        .acked(
            req::SET_MEM_TABLE,
            &mem_table_payload(1, &[region(GPA, MEM, 0)]),
            &[f.as_raw_fd()],
        )
        .map_err(err("SET_MEM_TABLE"))?;
    if ack != 0 {
        return Err(format!("valid SET_MEM_TABLE NACKed ({ack})"));
    }
    Ok((r, f))
}

/// A region whose user address is its guest address plus a fixed base.
fn region(gpa: u64, size: u64, mmap_offset: u64) -> RawRegion {
    RawRegion {
        gpa,
        size,
        user_addr: UADDR.wrapping_add(gpa),
        mmap_offset,
    }
}

/// Base of the user addresses the raw frontend claims (nothing is mapped
/// there: for the daemon they only name guest addresses).
const UADDR: u64 = 0x7000_0000_0000;

fn mem_table(r: &RawFrontend, regions: &[RawRegion], fds: &[RawFd]) -> io::Result<u64> {
    let n = u32::try_from(regions.len()).unwrap();
    r.acked(req::SET_MEM_TABLE, &mem_table_payload(n, regions), fds)
}

fn vring_addr(index: u32, desc: u64, avail: u64, used: u64) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend_from_slice(&0u32.to_le_bytes());
    for v in [desc, used, avail, 0] {
        p.extend_from_slice(&v.to_le_bytes());
    }
    p
}

/// Sets ring `i` up at user address `at` (16 entries), kicks it and gives
/// the daemon a moment; the eventfds are returned to keep them open.
fn raw_ring_kick(r: &RawFrontend, i: u32, at: u64) -> (EventFd, EventFd) {
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let _ = r.send(req::SET_VRING_NUM, &vring_state(i, 16), &[]);
    let _ = r.send(
        req::SET_VRING_ADDR,
        &vring_addr(i, at, at + 0x1000, at + 0x2000),
        &[],
    );
    let _ = r.send(req::SET_VRING_BASE, &vring_state(i, 0), &[]);
    let _ = r.send(
        req::SET_VRING_CALL,
        &u64::from(i).to_le_bytes(),
        &[call.as_raw_fd()],
    );
    let _ = r.send(
        req::SET_VRING_KICK,
        &u64::from(i).to_le_bytes(),
        &[kick.as_raw_fd()],
    );
    let _ = r.send(req::SET_VRING_ENABLE, &vring_state(i, 1), &[]);
    let _ = r.call(req::GET_FEATURES, &[]);
    let _ = kick.write(1);
    std::thread::sleep(Duration::from_millis(150));
    (kick, call)
}

fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: valid out array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fresh fds we own.
    unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
}

fn guest(d: &Daemon) -> Result<Guest, String> {
    Guest::try_connect_opts(d, None, &Opts::default())
}

/// Where the sentinel chains keep their data.
const SENTINEL_DATA: u64 = GPA + 0xc_0000;

/// Posts a valid chain on `q` after the hostile one and waits until the
/// daemon used it: the hostile chain was processed (in the same batch or
/// before), and the queue still works.
fn sentinel(g: &mut Guest, q: usize) -> Res {
    let page = GPA + 14 * MIB;
    let data = SENTINEL_DATA + q as u64 * 0x1000;
    let head = g.queues[q].next_desc;
    match q {
        INFLATE | 1 => {
            g.mem.write_obj(pfn(page), GuestAddress(data)).unwrap();
            if q == INFLATE {
                g.queues[q].push(&g.mem, &[(data, 4, false), (data + 0x100, 1, true)]);
            } else {
                g.queues[q].push(&g.mem, &[(data, 4, false)]);
            }
        }
        REPORTING => g.queues[q].push(&g.mem, &[(page, 4096, true)]),
        _ => return Err(format!("no sentinel for queue {q}")),
    }
    g.kick(q);
    wait_head(g, q, head)?;
    Ok(Outcome::Handled)
}

/// Waits until `head` shows up in the used ring of queue `q`.
fn wait_head(g: &Guest, q: usize, head: u16) -> Result<(), String> {
    let t = Instant::now();
    let tq = &g.queues[q];
    loop {
        let n = tq.used_idx(&g.mem);
        let from = n.saturating_sub(tq.size);
        if (from..n).any(|i| tq.used_elem(&g.mem, i).0 == u32::from(head)) {
            return Ok(());
        }
        if t.elapsed() > Duration::from_secs(10) {
            return Err(format!(
                "queue {q}: chain {head} never used (used idx {n}): the queue stopped"
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Raw descriptors start here in each ring (the sentinels use 0..8).
const HOSTILE_DESC: u16 = 8;

/// Writes `descs` (addr, len, flags, next) at HOSTILE_DESC.., posts the
/// first one, kicks, then runs the sentinel.
fn hostile_chain(g: &mut Guest, q: usize, descs: &[(u64, u32, u16, u16)]) -> Res {
    for (i, &(addr, len, flags, next)) in descs.iter().enumerate() {
        let idx = HOSTILE_DESC + u16::try_from(i).unwrap();
        g.queues[q].write_desc(&g.mem, idx, addr, len, flags, next);
    }
    g.queues[q].post(&g.mem, HOSTILE_DESC);
    g.kick(q);
    sentinel(g, q)
}

/// An inflate chain of `pfns` (array at GPA + 1 MiB) with a bitmap.
fn inflate_pfns(g: &mut Guest, pfns: &[u32]) -> Res {
    let arr = GPA + MIB;
    let bytes: Vec<u8> = pfns.iter().flat_map(|p| p.to_le_bytes()).collect();
    g.mem.write_slice(&bytes, GuestAddress(arr)).unwrap();
    let len = u32::try_from(bytes.len()).unwrap();
    let map = arr + u64::from(len);
    let bits = u32::try_from(pfns.len().div_ceil(8)).unwrap();
    hostile_chain(
        g,
        INFLATE,
        &[
            (arr, len, DESC_NEXT, HOSTILE_DESC + 1),
            (map, bits.max(1), DESC_WRITE, 0),
        ],
    )
}

fn report(g: &mut Guest, ranges: &[(u64, u32)]) -> Res {
    let n = ranges.len();
    let descs: Vec<(u64, u32, u16, u16)> = ranges
        .iter()
        .enumerate()
        .map(|(i, &(a, l))| {
            let next = HOSTILE_DESC + u16::try_from(i + 1).unwrap();
            let flags = if i + 1 < n {
                DESC_WRITE | DESC_NEXT
            } else {
                DESC_WRITE
            };
            (a, l, flags, if i + 1 < n { next } else { 0 })
        })
        .collect();
    hostile_chain(g, REPORTING, &descs)
}

fn header_cases() -> Vec<(&'static str, CaseFn)> {
    let hdr = |name, request: u32, flags: u32, size: u32, payload: Vec<u8>| {
        case(name, move |d| {
            let r = raw(d)?;
            let _ = r.send_sized(request, flags, size, &payload, &[]);
            ended(r)
        })
    };
    vec![
        hdr(
            "header: size 2^32-1",
            req::GET_FEATURES,
            1,
            u32::MAX,
            vec![],
        ),
        hdr(
            "header: size 64 KiB, no payload",
            req::GET_FEATURES,
            1,
            65536,
            vec![],
        ),
        hdr(
            "header: size 64 KiB + 1",
            req::GET_FEATURES,
            1,
            65537,
            vec![],
        ),
        hdr(
            "header: GET_FEATURES with 64 KiB of payload",
            req::GET_FEATURES,
            1,
            65536,
            vec![0; 65536],
        ),
        hdr("header: request 0", 0, 1, 0, vec![]),
        hdr("header: request 9999", 9999, 1, 0, vec![]),
        hdr("header: request 40 (not defined)", 40, 1, 0, vec![]),
        hdr("header: flags 0", req::GET_FEATURES, 0, 0, vec![]),
        hdr(
            "header: flags all ones",
            req::GET_FEATURES,
            u32::MAX,
            0,
            vec![],
        ),
        hdr(
            "header: reply flag on a request",
            req::GET_FEATURES,
            5,
            0,
            vec![],
        ),
        hdr(
            "header: GET_FEATURES with 8 payload bytes",
            req::GET_FEATURES,
            1,
            8,
            vec![0; 8],
        ),
        hdr(
            "header: payload shorter than its size",
            req::SET_FEATURES,
            1,
            8,
            vec![0; 3],
        ),
        case("header: truncated after 6 bytes", |d| {
            let r = raw(d)?;
            let _ = r.send_bytes(&[1, 0, 0, 0, 1, 0], &[]);
            ended(r)
        }),
        case("header: 12 zero bytes", |d| {
            let r = raw(d)?;
            let _ = r.send_bytes(&[0; 12], &[]);
            ended(r)
        }),
        case("garbage: 4 KiB of pseudo-random bytes", |d| {
            let r = raw(d)?;
            let mut x = 0x2545_f491_4f6c_dd1du64;
            let bytes: Vec<u8> = (0..4096)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let _ = r.send_bytes(&bytes, &[]);
            ended(r)
        }),
        case("GET_FEATURES with an fd attached", |d| {
            let r = raw(d)?;
            let e = EventFd::new(0).unwrap();
            let _ = r.send(req::GET_FEATURES, &[], &[e.as_raw_fd()]);
            ended(r)
        }),
        case("SET_OWNER with 40 fds", |d| {
            let r = raw(d)?;
            let fds: Vec<EventFd> = (0..40).map(|_| EventFd::new(0).unwrap()).collect();
            let raw_fds: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
            let _ = r.send(req::SET_OWNER, &[], &raw_fds);
            ended(r)
        }),
        case("SET_OWNER twice", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_OWNER, &[], &[]);
            let _ = r.send(req::SET_OWNER, &[], &[]);
            ended(r)
        }),
        case("1000 x GET_FEATURES", |d| {
            let r = raw(d)?;
            for _ in 0..1000 {
                r.get_u64(req::GET_FEATURES).map_err(err("GET_FEATURES"))?;
            }
            ended(r)
        }),
    ]
}

fn feature_cases() -> Vec<(&'static str, CaseFn)> {
    vec![
        case("SET_FEATURES all ones", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_OWNER, &[], &[]);
            let _ = r.get_u64(req::GET_FEATURES);
            let _ = r.send(req::SET_FEATURES, &u64::MAX.to_le_bytes(), &[]);
            ended(r)
        }),
        case("SET_FEATURES with a 4-byte payload", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_FEATURES, &[0xff; 4], &[]);
            ended(r)
        }),
        case("SET_FEATURES before GET_FEATURES", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_FEATURES, &(1u64 << 32).to_le_bytes(), &[]);
            ended(r)
        }),
        case("1000 x SET_FEATURES", |d| {
            let r = raw(d)?;
            let f = r
                .handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            for i in 0..1000u64 {
                // alternate PAGE_POISON: a new driver every time
                let v = f ^ ((i & 1) << 4);
                r.send(req::SET_FEATURES, &v.to_le_bytes(), &[])
                    .map_err(err("send"))?;
            }
            r.get_u64(req::GET_FEATURES).map_err(err("GET_FEATURES"))?;
            ended(r)
        }),
        case("SET_PROTOCOL_FEATURES all ones", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_OWNER, &[], &[]);
            let f = r.get_u64(req::GET_FEATURES).map_err(err("GET_FEATURES"))?;
            let _ = r.send(req::SET_FEATURES, &(f & !LOG_ALL).to_le_bytes(), &[]);
            let _ = r.send(req::SET_PROTOCOL_FEATURES, &u64::MAX.to_le_bytes(), &[]);
            ended(r)
        }),
        case("RESET_DEVICE without the protocol feature", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let _ = r.send(req::RESET_DEVICE, &[], &[]);
            ended(r)
        }),
        case("200 x RESET_DEVICE", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::RESET_DEVICE)?;
            for _ in 0..200 {
                let ack = r
                    .acked(req::RESET_DEVICE, &[], &[])
                    .map_err(err("RESET_DEVICE"))?;
                if ack != 0 {
                    return Ok(Outcome::Refused);
                }
            }
            ended(r)
        }),
        case("GET_QUEUE_NUM without MQ", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let _ = r.call(req::GET_QUEUE_NUM, &[]);
            ended(r)
        }),
    ]
}

fn mem_table_cases() -> Vec<(&'static str, CaseFn)> {
    let table = |name, regions: Vec<RawRegion>, num: Option<u32>, nfds: usize| {
        case(name, move |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let f = sealed_memfd(MEM, 0);
            let fds = vec![f.as_raw_fd(); nfds];
            let n = num.unwrap_or(u32::try_from(regions.len()).unwrap());
            let ack = r.acked(req::SET_MEM_TABLE, &mem_table_payload(n, &regions), &fds);
            by_ack(r, ack)
        })
    };
    let fd_case = |name, make: fn() -> (File, Option<File>)| {
        case(name, move |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let (f, _keep) = make();
            let ack = mem_table(&r, &[region(GPA, MEM, 0)], &[f.as_raw_fd()]);
            by_ack(r, ack)
        })
    };
    vec![
        table(
            "SET_MEM_TABLE: num 2^32-1",
            vec![region(GPA, MEM, 0)],
            Some(u32::MAX),
            1,
        ),
        table("SET_MEM_TABLE: num 0", vec![], None, 1),
        table(
            "SET_MEM_TABLE: 2 regions, 1 fd",
            vec![region(GPA, MIB, 0), region(GPA + MIB, MIB, MIB)],
            None,
            1,
        ),
        table("SET_MEM_TABLE: no fd", vec![region(GPA, MEM, 0)], None, 0),
        table(
            "SET_MEM_TABLE: 1 region, 2 fds",
            vec![region(GPA, MEM, 0)],
            None,
            2,
        ),
        table(
            "SET_MEM_TABLE: gpa wraps",
            vec![region(u64::MAX - 4095, MIB, 0)],
            None,
            1,
        ),
        table("SET_MEM_TABLE: size 0", vec![region(GPA, 0, 0)], None, 1),
        table(
            "SET_MEM_TABLE: mmap_offset 2^63",
            vec![region(GPA, MIB, 1 << 63)],
            None,
            1,
        ),
        table(
            "SET_MEM_TABLE: mmap_offset 1",
            vec![region(GPA, MIB, 1)],
            None,
            1,
        ),
        table(
            "SET_MEM_TABLE: overlapping regions",
            vec![region(GPA, 2 * MIB, 0), region(GPA + MIB, 2 * MIB, 0)],
            None,
            2,
        ),
        table(
            "SET_MEM_TABLE: one page past the end of the memfd",
            vec![region(GPA, MEM + 4096, 0)],
            None,
            1,
        ),
        table(
            "SET_MEM_TABLE: offset + size past the end of the memfd",
            vec![region(GPA, MEM, 4096)],
            None,
            1,
        ),
        table(
            "SET_MEM_TABLE: UML style, num 3 in 2 slots",
            vec![region(GPA, MEM, 0), region(GPA + MEM, MEM, 0)],
            Some(3),
            1,
        ),
        fd_case("SET_MEM_TABLE: fd is a pipe", || {
            let (a, b) = pipe();
            (a, Some(b))
        }),
        fd_case("SET_MEM_TABLE: fd is an eventfd", || {
            let e = EventFd::new(0).unwrap();
            // SAFETY: the duplicate is ours.
            (unsafe { File::from_raw_fd(libc::dup(e.as_raw_fd())) }, None)
        }),
        fd_case("SET_MEM_TABLE: fd is a read-only reopened memfd", || {
            let m = sealed_memfd(MEM, 0);
            let ro = File::open(format!("/proc/self/fd/{}", m.as_raw_fd())).unwrap();
            (ro, Some(m))
        }),
        fd_case("SET_MEM_TABLE: fd is a directory", || {
            (File::open(std::env::temp_dir()).unwrap(), None)
        }),
        fd_case("SET_MEM_TABLE: fd is a socket", || {
            let (a, b) = UnixStream::pair().unwrap();
            (
                File::from(std::os::fd::OwnedFd::from(a)),
                Some(File::from(std::os::fd::OwnedFd::from(b))),
            )
        }),
        fd_case("SET_MEM_TABLE: fd is /dev/null", || {
            (File::open("/dev/null").unwrap(), None)
        }),
        fd_case("SET_MEM_TABLE: memfd sealed against writes", || {
            let m = memfd_flags(MEM, libc::MFD_ALLOW_SEALING);
            add_seals(&m, libc::F_SEAL_SHRINK | libc::F_SEAL_WRITE);
            (m, None)
        }),
        case(
            "SET_MEM_TABLE: 1 TiB over a 1 MiB memfd, ring past the end, kick",
            |d| {
                let r = raw(d)?;
                r.handshake(VhostUserProtocolFeatures::empty())
                    .map_err(err("handshake"))?;
                let f = sealed_memfd(MIB, 0);
                let ack = mem_table(&r, &[region(0, 1 << 40, 0)], &[f.as_raw_fd()]);
                if matches!(ack, Ok(0)) {
                    let _k = raw_ring_kick(&r, 0, UADDR + 2 * MIB);
                }
                by_ack(r, ack)
            },
        ),
        case("SET_MEM_TABLE: unsealed memfd, truncated, kick", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let f = memfd(MEM);
            let ack = mem_table(&r, &[region(GPA, MEM, 0)], &[f.as_raw_fd()]);
            if matches!(ack, Ok(0)) {
                f.set_len(0).unwrap();
                let _k = raw_ring_kick(&r, 0, UADDR + GPA);
            }
            by_ack(r, ack)
        }),
        case(
            "SET_MEM_TABLE: memfd sealed against growing only, truncated, kick",
            |d| {
                let r = raw(d)?;
                r.handshake(VhostUserProtocolFeatures::empty())
                    .map_err(err("handshake"))?;
                let f = memfd_flags(MEM, libc::MFD_ALLOW_SEALING);
                add_seals(&f, libc::F_SEAL_GROW);
                let ack = mem_table(&r, &[region(GPA, MEM, 0)], &[f.as_raw_fd()]);
                if matches!(ack, Ok(0)) {
                    f.set_len(0).unwrap();
                    let _k = raw_ring_kick(&r, 0, UADDR + GPA);
                }
                by_ack(r, ack)
            },
        ),
        case(
            "SET_MEM_TABLE: sealed memfd, truncation refused, kick",
            |d| {
                let (r, f) = ready(d, VhostUserProtocolFeatures::empty())?;
                if f.set_len(0).is_ok() {
                    return Err("a memfd sealed against shrinking was truncated".into());
                }
                let _k = raw_ring_kick(&r, 0, UADDR + GPA);
                ended(r)
            },
        ),
        case(
            "SET_MEM_TABLE: regular file from an offset (UML), report",
            |d| {
                let mut g = Guest::try_connect_opts(
                    d,
                    None,
                    &Opts {
                        regular_file_offset: Some(MIB),
                        ..Opts::default()
                    },
                )?;
                sentinel(&mut g, REPORTING)
            },
        ),
        case(
            "SET_MEM_TABLE: regular file, region one page past its end",
            |d| {
                let r = raw(d)?;
                r.handshake(VhostUserProtocolFeatures::empty())
                    .map_err(err("handshake"))?;
                let f = tmp_file();
                f.set_len(MEM - 4096).unwrap();
                let ack = mem_table(&r, &[region(GPA, MEM, 0)], &[f.as_raw_fd()]);
                if matches!(ack, Ok(0)) {
                    let _k = raw_ring_kick(&r, 0, UADDR + GPA + MEM - 4096);
                }
                by_ack(r, ack)
            },
        ),
        case("100 x SET_MEM_TABLE", |d| {
            let (r, f) = ready(d, VhostUserProtocolFeatures::empty())?;
            for _ in 0..100 {
                let ack = mem_table(&r, &[region(GPA, MEM, 0)], &[f.as_raw_fd()])
                    .map_err(err("SET_MEM_TABLE"))?;
                if ack != 0 {
                    return Ok(Outcome::Refused);
                }
            }
            ended(r)
        }),
        case(
            "SET_MEM_TABLE: rings' memory removed by a new table, kick",
            |d| {
                let g = guest(d)?;
                let f = sealed_memfd(MEM, 0);
                let info = VhostUserMemoryRegionInfo {
                    guest_phys_addr: 4 * GPA,
                    memory_size: MEM,
                    userspace_addr: UADDR,
                    mmap_offset: 0,
                    mmap_handle: f.as_raw_fd(),
                };
                let res = g.fe.set_mem_table(&[info]);
                for q in 0..4 {
                    g.kick(q);
                }
                std::thread::sleep(Duration::from_millis(100));
                Ok(if res.is_ok() {
                    Outcome::Handled
                } else {
                    Outcome::Refused
                })
            },
        ),
    ]
}

fn vring_cases() -> Vec<(&'static str, CaseFn)> {
    let msg = |name, request: u32, payload: Vec<u8>| {
        case(name, move |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            let ack = r.acked(request, &payload, &[]);
            by_ack(r, ack)
        })
    };
    vec![
        msg(
            "SET_VRING_NUM: index 200",
            req::SET_VRING_NUM,
            vring_state(200, 16),
        ),
        msg("SET_VRING_NUM: 0", req::SET_VRING_NUM, vring_state(0, 0)),
        msg(
            "SET_VRING_NUM: 65535",
            req::SET_VRING_NUM,
            vring_state(0, 65535),
        ),
        msg("SET_VRING_NUM: 3", req::SET_VRING_NUM, vring_state(0, 3)),
        msg(
            "SET_VRING_NUM: 2048",
            req::SET_VRING_NUM,
            vring_state(0, 2048),
        ),
        msg(
            "SET_VRING_ADDR: index 200",
            req::SET_VRING_ADDR,
            vring_addr(200, UADDR + GPA, UADDR + GPA + 0x1000, UADDR + GPA + 0x2000),
        ),
        msg(
            "SET_VRING_ADDR: outside memory",
            req::SET_VRING_ADDR,
            vring_addr(0, 0x1000, 0x2000, 0x3000),
        ),
        msg(
            "SET_VRING_KICK: index 255",
            req::SET_VRING_KICK,
            255u64.to_le_bytes().to_vec(),
        ),
        msg(
            "SET_VRING_KICK: no fd, no NOFD flag",
            req::SET_VRING_KICK,
            0u64.to_le_bytes().to_vec(),
        ),
        msg(
            "GET_VRING_BASE: index 300",
            req::GET_VRING_BASE,
            vring_state(300, 0),
        ),
        msg(
            "SET_VRING_ENABLE: index 200",
            req::SET_VRING_ENABLE,
            vring_state(200, 1),
        ),
        case("SET_VRING_ADDR without a memory table", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            let ack = r.acked(
                req::SET_VRING_ADDR,
                &vring_addr(0, 0x1000, 0x2000, 0x3000),
                &[],
            );
            by_ack(r, ack)
        }),
        case("SET_VRING_ADDR: misaligned used ring, kick", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            let at = UADDR + GPA;
            let _ = r.send(req::SET_VRING_NUM, &vring_state(0, 16), &[]);
            let ack = r.acked(
                req::SET_VRING_ADDR,
                &vring_addr(0, at, at + 0x1000, at + 0x2001),
                &[],
            );
            let k = EventFd::new(0).unwrap();
            let _ = r.send(req::SET_VRING_KICK, &0u64.to_le_bytes(), &[k.as_raw_fd()]);
            let _ = k.write(1);
            std::thread::sleep(Duration::from_millis(50));
            by_ack(r, ack)
        }),
        case("SET_VRING_KICK: kick fd is a pipe", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            let at = UADDR + GPA;
            let _ = r.send(req::SET_VRING_NUM, &vring_state(0, 16), &[]);
            let _ = r.send(
                req::SET_VRING_ADDR,
                &vring_addr(0, at, at + 0x1000, at + 0x2000),
                &[],
            );
            let (rd, mut wr) = pipe();
            let _ = r.send(req::SET_VRING_KICK, &0u64.to_le_bytes(), &[rd.as_raw_fd()]);
            let _ = wr.write_all(&[1]);
            std::thread::sleep(Duration::from_millis(50));
            let _ = wr.write_all(&[1; 8]);
            std::thread::sleep(Duration::from_millis(50));
            ended(r)
        }),
        case("SET_VRING_CALL: call fd is a pipe, report", |d| {
            let mut g = guest(d)?;
            let (_rd, wr) = pipe();
            // SAFETY: the duplicate is ours; an EventFd only wraps the fd.
            let wr = unsafe { EventFd::from_raw_fd(libc::dup(wr.as_raw_fd())) };
            g.fe.set_vring_call(REPORTING, &wr)
                .map_err(err("SET_VRING_CALL"))?;
            sentinel(&mut g, REPORTING)
        }),
        case("10 x GET_VRING_BASE before any setup", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::empty())
                .map_err(err("handshake"))?;
            for _ in 0..10 {
                if r.call(req::GET_VRING_BASE, &vring_state(0, 0)).is_err() {
                    return Ok(Outcome::Refused);
                }
            }
            ended(r)
        }),
        case("SET_VRING_BASE on a running ring, report", |d| {
            let mut g = guest(d)?;
            g.fe.set_vring_base(REPORTING, 0)
                .map_err(err("SET_VRING_BASE"))?;
            let k = EventFd::new(0).unwrap();
            g.fe.set_vring_kick(REPORTING, &k)
                .map_err(err("SET_VRING_KICK"))?;
            g.kicks[REPORTING] = k;
            sentinel(&mut g, REPORTING)
        }),
        case("SET_VRING_NUM on a running ring", |d| {
            let g = guest(d)?;
            g.fe.set_vring_num(INFLATE, 16)
                .map_err(err("SET_VRING_NUM"))?;
            Ok(Outcome::Handled)
        }),
        case("200 x SET_VRING_KICK on a running ring, report", |d| {
            let mut g = guest(d)?;
            for _ in 0..200 {
                let k = EventFd::new(0).unwrap();
                g.fe.set_vring_kick(REPORTING, &k)
                    .map_err(err("SET_VRING_KICK"))?;
                g.kicks[REPORTING] = k;
            }
            sentinel(&mut g, REPORTING)
        }),
    ]
}

fn config_cases() -> Vec<(&'static str, CaseFn)> {
    let get_config = |name, offset: u32, size: u32| {
        case(name, move |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            let mut p = offset.to_le_bytes().to_vec();
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            p.resize(12 + size as usize, 0);
            let _ = r.call(req::GET_CONFIG, &p);
            ended(r)
        })
    };
    vec![
        get_config("GET_CONFIG: size 0xffff", 0, 0xffff),
        get_config("GET_CONFIG: size 4096", 0, 4096),
        get_config("GET_CONFIG: offset 0xfffffff0", 0xffff_fff0, 16),
        get_config("GET_CONFIG: size 0", 0, 0),
        case("SET_CONFIG: size larger than its payload", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            let mut p = 4u32.to_le_bytes().to_vec();
            p.extend_from_slice(&64u32.to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            p.extend_from_slice(&[1, 2, 3, 4]);
            let ack = r.acked(req::SET_CONFIG, &p, &[]);
            by_ack(r, ack)
        }),
        case("GET_CONFIG without the CONFIG protocol feature", |d| {
            let r = raw(d)?;
            let _ = r.send(req::SET_OWNER, &[], &[]);
            let f = r.get_u64(req::GET_FEATURES).map_err(err("GET_FEATURES"))?;
            let _ = r.send(req::SET_FEATURES, &(f & !LOG_ALL).to_le_bytes(), &[]);
            let _ = r.send(req::SET_PROTOCOL_FEATURES, &0u64.to_le_bytes(), &[]);
            let mut p = vec![0u8; 12];
            p[4] = 16;
            p.resize(28, 0);
            let _ = r.call(req::GET_CONFIG, &p);
            ended(r)
        }),
        case("1000 x SET_CONFIG to num_pages", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            for i in 0..1000u32 {
                let mut p = 0u32.to_le_bytes().to_vec();
                p.extend_from_slice(&4u32.to_le_bytes());
                p.extend_from_slice(&0u32.to_le_bytes());
                p.extend_from_slice(&i.to_le_bytes());
                let ack = r
                    .acked(req::SET_CONFIG, &p, &[])
                    .map_err(err("SET_CONFIG"))?;
                if ack != 0 {
                    return Ok(Outcome::Refused);
                }
            }
            ended(r)
        }),
        case("1000 x SET_CONFIG alternating poison_val", |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::empty())?;
            for i in 0..1000u32 {
                let mut p = 12u32.to_le_bytes().to_vec();
                p.extend_from_slice(&4u32.to_le_bytes());
                p.extend_from_slice(&0u32.to_le_bytes());
                p.extend_from_slice(&(i & 1).to_le_bytes());
                let ack = r
                    .acked(req::SET_CONFIG, &p, &[])
                    .map_err(err("SET_CONFIG"))?;
                if ack != 0 {
                    return Ok(Outcome::Refused);
                }
            }
            ended(r)
        }),
    ]
}

fn log_and_channel_cases() -> Vec<(&'static str, CaseFn)> {
    let log_base = |name, mmap_size: u64, file_size: Option<u64>| {
        case(name, move |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::LOG_SHMFD)?;
            let mut p = mmap_size.to_le_bytes().to_vec();
            p.extend_from_slice(&0u64.to_le_bytes());
            let (fd, _keep) = match file_size {
                Some(n) => {
                    let m = sealed_memfd(n, 0);
                    (m.as_raw_fd(), Some(m))
                }
                None => (-1, None),
            };
            let fds: Vec<RawFd> = if fd >= 0 { vec![fd] } else { vec![] };
            let _ = r.send(req::SET_LOG_BASE, &p, &fds);
            let _ = r.recv();
            ended(r)
        })
    };
    let needed = (GPA + MEM) / 4096 / 8;
    vec![
        log_base("SET_LOG_BASE: no fd", needed, None),
        log_base(
            "SET_LOG_BASE: log too small for guest memory",
            64,
            Some(4096),
        ),
        case("SET_LOG_BASE: fd is a pipe", move |d| {
            let (r, _f) = ready(d, VhostUserProtocolFeatures::LOG_SHMFD)?;
            let mut p = needed.to_le_bytes().to_vec();
            p.extend_from_slice(&0u64.to_le_bytes());
            let (a, _b) = pipe();
            let _ = r.send(req::SET_LOG_BASE, &p, &[a.as_raw_fd()]);
            let _ = r.recv();
            ended(r)
        }),
        case(
            "SET_LOG_BASE: log memfd shorter than its size, LOG_ALL report",
            move |d| {
                let mut g = Guest::try_connect_opts(
                    d,
                    None,
                    &Opts {
                        log_all: true,
                        protocol: VhostUserProtocolFeatures::LOG_SHMFD,
                        ..Opts::default()
                    },
                )?;
                let log = memfd(4096);
                let res = g.fe.set_log_base(
                    0,
                    Some(vhost::VhostUserDirtyLogRegion {
                        mmap_size: needed,
                        mmap_offset: 0,
                        mmap_handle: log.as_raw_fd(),
                    }),
                );
                if res.is_err() {
                    return Ok(Outcome::Refused);
                }
                sentinel(&mut g, REPORTING)
            },
        ),
        case("SET_BACKEND_REQ_FD: a pipe, set_target", |d| {
            let (rd, wr) = pipe();
            let _g = Guest::try_connect_opts(d, Some(&wr), &Opts::default())?;
            drop(rd);
            let r = control(d, r#"{"cmd":"set_target","pages":5}"#);
            if r["target"] != 5 {
                return Err(format!("set_target: {r}"));
            }
            Ok(Outcome::Handled)
        }),
        case("SET_BACKEND_REQ_FD: no fd", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::BACKEND_REQ)
                .map_err(err("handshake"))?;
            let ack = r.acked(req::SET_BACKEND_REQ_FD, &[], &[]);
            by_ack(r, ack)
        }),
        case("100 x SET_BACKEND_REQ_FD", |d| {
            let r = raw(d)?;
            r.handshake(VhostUserProtocolFeatures::BACKEND_REQ)
                .map_err(err("handshake"))?;
            let mut keep = Vec::new();
            for _ in 0..100 {
                let (a, b) = UnixStream::pair().unwrap();
                let ack = r
                    .acked(req::SET_BACKEND_REQ_FD, &[], &[b.as_raw_fd()])
                    .map_err(err("SET_BACKEND_REQ_FD"))?;
                if ack != 0 {
                    return Ok(Outcome::Refused);
                }
                keep.push(a);
            }
            ended(r)
        }),
        case(
            "backend channel never read (1-page socket buffer), 20 x set_target",
            |d| {
                let (_ours, theirs) = UnixStream::pair().unwrap();
                let one: libc::c_int = 1;
                // SAFETY: setsockopt on a socket we own with a valid int.
                let rc = unsafe {
                    libc::setsockopt(
                        theirs.as_raw_fd(),
                        libc::SOL_SOCKET,
                        libc::SO_SNDBUF,
                        (&one as *const libc::c_int).cast(),
                        std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                    )
                };
                assert_eq!(rc, 0);
                let _g = Guest::try_connect_opts(d, Some(&theirs), &Opts::default())?;
                drop(theirs);
                let s = UnixStream::connect(&d.ctl).map_err(err("control"))?;
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut w = s.try_clone().unwrap();
                let mut rd = BufReader::new(s);
                for i in 0..20 {
                    writeln!(w, r#"{{"cmd":"set_target","pages":{i}}}"#).map_err(err("control"))?;
                    let mut line = String::new();
                    rd.read_line(&mut line)
                        .map_err(|e| format!("set_target #{i}: no answer: {e}"))?;
                }
                Ok(Outcome::Handled)
            },
        ),
    ]
}

fn guest_cases() -> Vec<(&'static str, CaseFn)> {
    let g = |name, f: fn(&mut Guest) -> Res| {
        case(name, move |d| {
            let mut g = guest(d)?;
            f(&mut g)
        })
    };
    let page = GPA + 4 * MIB;
    vec![
        g("inflate: PFN 0xffffffff", |g| inflate_pfns(g, &[u32::MAX])),
        g("inflate: no bitmap", |g| {
            g.mem
                .write_obj(pfn(GPA + 4 * MIB), GuestAddress(GPA + MIB))
                .unwrap();
            hostile_chain(g, INFLATE, &[(GPA + MIB, 4, 0, 0)])
        }),
        g("inflate: zero-length descriptor", |g| {
            hostile_chain(g, INFLATE, &[(GPA + MIB, 0, 0, 0)])
        }),
        g("inflate: descriptor at 1 TiB", |g| {
            hostile_chain(g, INFLATE, &[(1 << 40, 4, 0, 0)])
        }),
        g("inflate: descriptor address wraps", |g| {
            hostile_chain(g, INFLATE, &[(u64::MAX - 1, 4, 0, 0)])
        }),
        g("inflate: descriptor loops to itself", |g| {
            hostile_chain(g, INFLATE, &[(GPA + MIB, 4, DESC_NEXT, HOSTILE_DESC)])
        }),
        g("inflate: two descriptors loop", |g| {
            hostile_chain(
                g,
                INFLATE,
                &[
                    (GPA + MIB, 4, DESC_NEXT, HOSTILE_DESC + 1),
                    (GPA + MIB, 4, DESC_NEXT, HOSTILE_DESC),
                ],
            )
        }),
        g("inflate: next index 5000", |g| {
            hostile_chain(g, INFLATE, &[(GPA + MIB, 4, DESC_NEXT, 5000)])
        }),
        g("inflate: 5-byte PFN array", |g| {
            hostile_chain(g, INFLATE, &[(GPA + MIB, 5, 0, 0)])
        }),
        g("inflate: PFN array over 256 KiB", |g| {
            hostile_chain(g, INFLATE, &[(GPA + MIB, 256 * 1024 + 4, 0, 0)])
        }),
        g("inflate: two 4 GiB - 1 descriptors", |g| {
            hostile_chain(
                g,
                INFLATE,
                &[
                    (GPA + MIB, u32::MAX, DESC_NEXT, HOSTILE_DESC + 1),
                    (GPA + MIB, u32::MAX, 0, 0),
                ],
            )
        }),
        g("inflate: bitmap outside memory", |g| {
            g.mem
                .write_obj(pfn(GPA + 4 * MIB), GuestAddress(GPA + MIB))
                .unwrap();
            hostile_chain(
                g,
                INFLATE,
                &[
                    (GPA + MIB, 4, DESC_NEXT, HOSTILE_DESC + 1),
                    (1 << 40, 1, DESC_WRITE, 0),
                ],
            )
        }),
        g("inflate: bitmap of 0 bytes", |g| {
            g.mem
                .write_obj(pfn(GPA + 4 * MIB), GuestAddress(GPA + MIB))
                .unwrap();
            hostile_chain(
                g,
                INFLATE,
                &[
                    (GPA + MIB, 4, DESC_NEXT, HOSTILE_DESC + 1),
                    (GPA + 2 * MIB, 0, DESC_WRITE, 0),
                ],
            )
        }),
        g("inflate: read/write flags swapped", |g| {
            g.mem
                .write_obj(pfn(GPA + 4 * MIB), GuestAddress(GPA + MIB))
                .unwrap();
            hostile_chain(
                g,
                INFLATE,
                &[
                    (GPA + MIB, 4, DESC_WRITE | DESC_NEXT, HOSTILE_DESC + 1),
                    (GPA + 2 * MIB, 1, 0, 0),
                ],
            )
        }),
        g("inflate: head 5000 before a valid chain", |g| {
            g.queues[INFLATE].post(&g.mem, 5000);
            sentinel(g, INFLATE)
        }),
        g("inflate: avail idx 1000 ahead", |g| {
            let q = &g.queues[INFLATE];
            g.mem
                .write_obj(q.avail_idx.wrapping_add(1000), GuestAddress(q.avail + 2))
                .unwrap();
            g.kick(INFLATE);
            std::thread::sleep(Duration::from_millis(50));
            g.kick(INFLATE);
            std::thread::sleep(Duration::from_millis(50));
            Ok(Outcome::Handled)
        }),
        g("inflate: 16 chains of 65536 PFNs outside memory", |g| {
            let arr = GPA + MIB;
            let bytes: Vec<u8> = (0..65_536u32)
                .flat_map(|i| (0x10_0000 + 2 * i).to_le_bytes())
                .collect();
            g.mem.write_slice(&bytes, GuestAddress(arr)).unwrap();
            let len = u32::try_from(bytes.len()).unwrap();
            for _ in 0..16 {
                g.queues[INFLATE].push(
                    &g.mem,
                    &[(arr, len, false), (arr + u64::from(len), 8192, true)],
                );
            }
            g.kick(INFLATE);
            g.queues[INFLATE]
                .try_wait_used(&g.mem, 16, Duration::from_secs(30))
                .map(|()| Outcome::Handled)
        }),
        g("deflate: PFN 0xffffffff", |g| {
            g.mem.write_obj(u32::MAX, GuestAddress(GPA + MIB)).unwrap();
            hostile_chain(g, 1, &[(GPA + MIB, 4, 0, 0)])
        }),
        g("deflate: 65536 PFNs outside memory", |g| {
            let bytes: Vec<u8> = (0..65_536u32)
                .flat_map(|i| (0x10_0000 + i).to_le_bytes())
                .collect();
            g.mem.write_slice(&bytes, GuestAddress(GPA + MIB)).unwrap();
            hostile_chain(g, 1, &[(GPA + MIB, 256 * 1024, 0, 0)])
        }),
        g("report: range wraps 2^64", |g| {
            report(g, &[(u64::MAX - 4095, 8192)])
        }),
        g("report: length 0", |g| report(g, &[(GPA + 4 * MIB, 0)])),
        g("report: unaligned start", |g| {
            report(g, &[(GPA + 4 * MIB + 1, 4096)])
        }),
        g("report: unaligned length", |g| {
            report(g, &[(GPA + 4 * MIB, 4095)])
        }),
        g("report: half outside memory", |g| {
            report(g, &[(GPA + MEM - 4096, 8192)])
        }),
        g("report: below guest memory", |g| report(g, &[(0, 4096)])),
        g("report: valid and invalid ranges", |g| {
            report(g, &[(GPA + 4 * MIB, 4096), (1 << 40, 4096)])
        }),
        g("report: read-only descriptor", |g| {
            hostile_chain(g, REPORTING, &[(GPA + 4 * MIB, 4096, 0, 0)])
        }),
        g("report: the rings' own pages", |g| {
            report(g, &[(GPA, 64 * 1024)])
        }),
        g("report: all of guest memory", |g| {
            report(g, &[(GPA, u32::try_from(MEM).unwrap())])
        }),
        g("report: 16 ranges outside memory", |g| {
            let r: Vec<(u64, u32)> = (0..8u64).map(|i| ((i + 1) << 40, 4096)).collect();
            report(g, &r)
        }),
        g("report: indirect descriptor", |g| {
            let t = GPA + MIB;
            write_desc(&g.mem, t, 0, GPA + 4 * MIB, 4096, DESC_WRITE, 0);
            hostile_chain(g, REPORTING, &[(t, 16, DESC_INDIRECT, 0)])
        }),
        g("report: 1100 indirect descriptors", |g| {
            let t = GPA + MIB;
            for i in 0..1100u16 {
                let flags = if i + 1 < 1100 {
                    DESC_WRITE | DESC_NEXT
                } else {
                    DESC_WRITE
                };
                write_desc(&g.mem, t, i, GPA + 4 * MIB, 4096, flags, i + 1);
            }
            hostile_chain(g, REPORTING, &[(t, 1100 * 16, DESC_INDIRECT, 0)])
        }),
        g("report: indirect table of 17 bytes", |g| {
            let t = GPA + MIB;
            write_desc(&g.mem, t, 0, GPA + 4 * MIB, 4096, DESC_WRITE, 0);
            hostile_chain(g, REPORTING, &[(t, 17, DESC_INDIRECT, 0)])
        }),
        g("report: indirect table that refers to itself", |g| {
            let t = GPA + MIB;
            write_desc(&g.mem, t, 0, t, 16, DESC_INDIRECT, 0);
            hostile_chain(g, REPORTING, &[(t, 16, DESC_INDIRECT, 0)])
        }),
        g("report: indirect table outside memory", |g| {
            hostile_chain(g, REPORTING, &[(1 << 40, 16, DESC_INDIRECT, 0)])
        }),
        g("report: 16 chains of 8 bad ranges", |g| {
            let r: Vec<(u64, u32, bool)> = (0..8u64).map(|i| ((i + 1) << 40, 4096, true)).collect();
            for _ in 0..16 {
                g.queues[REPORTING].push(&g.mem, &r);
            }
            g.kick(REPORTING);
            g.queues[REPORTING]
                .try_wait_used(&g.mem, 16, Duration::from_secs(10))
                .map(|()| Outcome::Handled)
        }),
        g("stats: 70000 bytes", |g| {
            g.queues[STATS].push(&g.mem, &[(GPA + MIB, 70_000, false)]);
            g.kick(STATS);
            std::thread::sleep(Duration::from_millis(30));
            sentinel(g, INFLATE)
        }),
        g("stats: 7 bytes", |g| {
            g.queues[STATS].push(&g.mem, &[(GPA + MIB, 7, false)]);
            g.kick(STATS);
            std::thread::sleep(Duration::from_millis(30));
            sentinel(g, INFLATE)
        }),
        g("stats: 200 buffers", |g| {
            for i in 0..200u16 {
                g.queues[STATS].push(&g.mem, &[(GPA + MIB, 10, false)]);
                g.kick(STATS);
                if i % 8 == 7 {
                    g.queues[STATS].try_wait_used(&g.mem, i, Duration::from_secs(5))?;
                }
            }
            Ok(Outcome::Handled)
        }),
        g("kick on every ring index, report", |g| {
            for q in 0..4 {
                g.kick(q);
            }
            sentinel(g, REPORTING)
        }),
        case("kick on a ring that was not negotiated", |d| {
            let g = Guest::try_connect_opts(
                d,
                None,
                &Opts {
                    clear_features: 1 << 1,
                    ..Opts::default()
                },
            )?;
            for _ in 0..100 {
                g.kick(3);
                std::thread::sleep(Duration::from_millis(1));
            }
            Ok(Outcome::Handled)
        }),
        case("inflate: 65536 PFNs with LOG_ALL and no log", move |d| {
            let mut g = Guest::try_connect_opts(
                d,
                None,
                &Opts {
                    mem_size: 512 * MIB,
                    log_all: true,
                    ..Opts::default()
                },
            )?;
            let pfns: Vec<u32> = (0..65_536u64)
                .map(|i| pfn(GPA + 2 * MIB + 8192 * i))
                .collect();
            let t = Instant::now();
            let o = inflate_pfns(&mut g, &pfns)?;
            if t.elapsed() > Duration::from_secs(5) {
                return Err(format!("took {:?}", t.elapsed()));
            }
            let _ = page;
            Ok(o)
        }),
    ]
}

/// Cases that need reports in flight (a daemon with a discard delay).
fn inflight_cases() -> Vec<(&'static str, CaseFn)> {
    let with_reports = |name, then: fn(&mut Guest) -> Res| {
        case(name, move |d| {
            let mut g = Guest::try_connect_opts(
                d,
                None,
                &Opts {
                    protocol: VhostUserProtocolFeatures::RESET_DEVICE,
                    ..Opts::default()
                },
            )?;
            for i in 0..4u64 {
                g.queues[REPORTING].push(&g.mem, &[(GPA + (4 + i) * MIB, MIB as u32, true)]);
            }
            g.kick(REPORTING);
            std::thread::sleep(Duration::from_millis(20));
            then(&mut g)
        })
    };
    vec![
        with_reports("in flight: SET_MEM_TABLE", |g| {
            let f = sealed_memfd(MEM, 0);
            let info = VhostUserMemoryRegionInfo {
                guest_phys_addr: GPA,
                memory_size: MEM,
                userspace_addr: UADDR,
                mmap_offset: 0,
                mmap_handle: f.as_raw_fd(),
            };
            g.fe.set_mem_table(&[info]).map_err(err("SET_MEM_TABLE"))?;
            Ok(Outcome::Handled)
        }),
        with_reports("in flight: RESET_DEVICE", |g| {
            g.fe.reset_device().map_err(err("RESET_DEVICE"))?;
            Ok(Outcome::Handled)
        }),
        with_reports("in flight: GET_VRING_BASE", |g| {
            g.fe.get_vring_base(REPORTING)
                .map_err(err("GET_VRING_BASE"))?;
            Ok(Outcome::Handled)
        }),
        with_reports("in flight: frontend closes", |_| Ok(Outcome::Handled)),
        with_reports("in flight: memfd sealed, truncation refused", |g| {
            if g.file.set_len(0).is_ok() {
                return Err("truncated".into());
            }
            Ok(Outcome::Handled)
        }),
    ]
}

/// Runs `cases` against one daemon started with `args`; returns
/// (refused, handled, failures, log lines per case).
fn run_suite(
    name: &str,
    args: &[&str],
    cases: Vec<(&'static str, CaseFn)>,
) -> (usize, usize, Vec<String>, Vec<usize>) {
    let mut d = start_daemon_logged(name, args);
    let (mut refused, mut handled) = (0, 0);
    let mut failures = Vec::new();
    let mut lines = Vec::new();
    let mut restarts = 0;
    for (case_name, f) in cases {
        let before = d.log_lines();
        let t = Instant::now();
        let verdict = f(&d)
            .and_then(|o| serves_a_new_frontend(&mut d).map(|()| o))
            .and_then(|o| {
                let n = d.log_lines() - before;
                if n > MAX_CASE_LOG_LINES {
                    Err(format!("{n} log lines:\n{}", d.log_since(before, 6)))
                } else {
                    Ok((o, n))
                }
            });
        let ms = t.elapsed().as_millis();
        match verdict {
            Ok((o, n)) => {
                println!("{case_name:<72} {o:?} {n:>3} lines {ms:>5} ms");
                lines.push(n);
                match o {
                    Outcome::Refused => refused += 1,
                    Outcome::Handled => handled += 1,
                }
            }
            Err(e) => {
                let e = match d.alive() {
                    Ok(()) => e,
                    Err(dead) => format!("{dead} ({e})"),
                };
                println!("{case_name:<72} FAILED {ms:>5} ms: {e}");
                failures.push(format!("{case_name}: {e}"));
                lines.push(d.log_lines().saturating_sub(before));
                if d.alive().is_err() {
                    // (a new directory: dropping the old daemon removes its own)
                    restarts += 1;
                    d = start_daemon_logged(&format!("{name}-{restarts}"), args);
                }
            }
        }
    }
    (refused, handled, failures, lines)
}

#[test]
fn hostile_frontend_suite() {
    let t = Instant::now();
    let mut cases = header_cases();
    cases.extend(feature_cases());
    cases.extend(mem_table_cases());
    cases.extend(vring_cases());
    cases.extend(config_cases());
    cases.extend(log_and_channel_cases());
    cases.extend(guest_cases());
    let inflight = inflight_cases();
    let total = cases.len() + inflight.len();
    assert!(total >= 90, "{total} cases");
    let (r1, h1, mut failures, mut lines) = run_suite("suite", &[], cases);
    let (r2, h2, f2, l2) = run_suite("suite-inflight", &["--discard-delay-ms", "200"], inflight);
    failures.extend(f2);
    lines.extend(l2);
    println!(
        "{total} cases in {:.1} s: {} refused, {} handled, {} failed; log lines per case: max {}, total {}",
        t.elapsed().as_secs_f64(),
        r1 + r2,
        h1 + h2,
        failures.len(),
        lines.iter().max().copied().unwrap_or(0),
        lines.iter().sum::<usize>()
    );
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
