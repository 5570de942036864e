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
