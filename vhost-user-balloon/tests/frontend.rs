//! Integration tests: start the daemon binary and drive it with a small
//! hand-written vhost-user frontend (`tests/common/mod.rs`) over a real
//! socket, with real shared memfd guest memory.

mod common;

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use common::*;
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vhost::VhostBackend;
use vm_memory::{Bytes, GuestAddress};

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
    assert_eq!(
        g.queues[REPORTING].used_len(&g.mem, 0),
        (4 * MIB) as u32,
        "bit 6: used length = total length of an initialized report"
    );
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
    assert_eq!(c["init_guarantees"]["device_init_reported"], true);
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
            (GPA + MEM, 1 << 31, true),     // huge, starts outside
        ],
    );
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 2);
    assert_eq!(
        g.queues[REPORTING].used_len(&g.mem, 1),
        0,
        "bit 6: a report with rejected ranges is not initialized"
    );
    assert!(
        g.read(GPA + MIB, 15 * MIB).iter().all(|&b| b == 0xcd),
        "no byte of guest RAM changed"
    );
    assert_eq!(g.blocks(), blocks_before);
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    let r = &c["counters"]["rejects"];
    assert_eq!(r["outside_memory"], 3, "{c}");
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
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 2), MIB as u32);
    assert!(g.read(GPA + 12 * MIB, MIB).iter().all(|&b| b == 0));
    assert!(g.read(GPA + 13 * MIB, 4096).iter().all(|&b| b == 0xcd));
}

/// get_counters answers with the config space and the counters of one
/// moment: a client that waits for a counter may read the config fields
/// the same writes set. The frontend writes `actual` = i and then a
/// rejected write, round after round, while the control socket is polled:
/// no answer may count more rejected writes than the rounds its `actual`
/// shows, or fewer than the rounds before it.
#[test]
fn counters_and_config_space_are_one_snapshot() {
    const ROUNDS: u32 = 2000;
    let d = start_daemon_with(
        "snapshot",
        &["--log-level", "error", "--initial-target", "1000"],
    );
    let mut g = Guest::connect(&d, None);
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let mut answers = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let c = control(&d, r#"{"cmd":"get_counters"}"#);
                let actual = c["actual"].as_u64().unwrap();
                let rejects = c["counters"]["config_write_rejects"].as_u64().unwrap();
                assert!(
                    rejects <= actual && actual <= rejects + 1,
                    "torn answer after {answers}: actual {actual}, rejected writes {rejects}"
                );
                answers += 1;
            }
            answers
        });
        for i in 1..=ROUNDS {
            g.fe.set_config(4, VhostUserConfigFlags::WRITABLE, &i.to_le_bytes())
                .unwrap();
            g.fe.set_config(0, VhostUserConfigFlags::WRITABLE, &1u32.to_le_bytes())
                .unwrap();
        }
        let c = wait_counters(&d, |c| c["counters"]["config_write_rejects"] == ROUNDS);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(c["actual"], ROUNDS);
        assert!(poller.join().expect("poller") > 0);
    });
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
    // bit 7: the chain ends with a device-writable bitmap, one bit per PFN
    let bitmap = data + 0x800;
    g.mem.write_obj(0xffu8, GuestAddress(bitmap)).unwrap();
    g.queues[INFLATE].push(
        &g.mem,
        &[(data, pfns.len() as u32, false), (bitmap, 1, true)],
    );
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    assert_eq!(g.queues[INFLATE].used_len(&g.mem, 0), 1, "bitmap length");
    assert_eq!(
        g.mem.read_obj::<u8>(GuestAddress(bitmap)).unwrap(),
        0b0111,
        "PFNs 0-2 initialized, the one outside RAM not"
    );
    assert!(g.read(pages, 3 * 4096).iter().all(|&b| b == 0));
    assert!(g.read(pages - 4096, 4096).iter().all(|&b| b == 0x11));
    assert!(g.read(pages + 3 * 4096, 4096).iter().all(|&b| b == 0x11));
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["inflated_pages"], 4);
    assert_eq!(c["counters"]["discarded_bytes"], 3 * 4096);
    assert_eq!(c["counters"]["rejects"]["outside_memory"], 1);
    assert_eq!(c["counters"]["pfns_not_initialized"], 1);

    // a chain without the bitmap (a driver of the older reading of bit 7):
    // the page is still released, the chain returned with used length 0
    let page = pages + 8 * 4096;
    g.fill(page, 4096, 0x11);
    g.mem
        .write_slice(&((page >> 12) as u32).to_le_bytes(), GuestAddress(data))
        .unwrap();
    g.queues[INFLATE].push(&g.mem, &[(data, 4, false)]);
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 2);
    assert_eq!(g.queues[INFLATE].used_len(&g.mem, 1), 0);
    assert!(g.read(page, 4096).iter().all(|&b| b == 0));
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["inflate_bitmap_errors"], 1, "{c}");
    assert_eq!(c["counters"]["pfns_not_initialized"], 2, "{c}");

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

/// Memory that cannot be discarded (a sealed memfd: `fallocate` fails with
/// EPERM) is zero-filled before the report or inflate is acknowledged as
/// initialized.
#[test]
fn failed_discard_falls_back_to_zero_fill_before_ack() {
    let d = start_daemon("sealed", &[]);
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            memfd_flags: libc::MFD_ALLOW_SEALING,
            ..Opts::default()
        },
    );
    g.fill(GPA + MIB, 8 * MIB, 0xab);
    // Existing shared mappings stay writable; hole punching is refused.
    // SAFETY: fcntl on a valid fd we own.
    let rc = unsafe {
        libc::fcntl(
            g.file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_FUTURE_WRITE,
        )
    };
    assert_eq!(rc, 0, "seal: {}", std::io::Error::last_os_error());

    let start = GPA + 4 * MIB;
    g.queues[REPORTING].push(&g.mem, &[(start, (2 * MIB) as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert!(
        g.read(start, 2 * MIB).iter().all(|&b| b == 0),
        "a report acknowledged as initialized reads zero although the discard failed"
    );
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), (2 * MIB) as u32);
    assert!(g.read(start - 4096, 4096).iter().all(|&b| b == 0xab));

    // the same for an inflated page under bit 7
    let data = GPA + 0x10_0000;
    let page = GPA + 7 * MIB;
    g.mem
        .write_obj(((page >> 12) as u32).to_le_bytes(), GuestAddress(data))
        .unwrap();
    g.mem.write_obj(0u8, GuestAddress(data + 0x800)).unwrap();
    g.queues[INFLATE].push(&g.mem, &[(data, 4, false), (data + 0x800, 1, true)]);
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    assert!(g.read(page, 4096).iter().all(|&b| b == 0));
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(data + 0x800)).unwrap(), 1);

    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["discard_errors"], 2, "{c}");
    assert_eq!(c["counters"]["zero_filled_bytes"], 2 * MIB + 4096, "{c}");
    assert_eq!(c["counters"]["discarded_bytes"], 0, "{c}");
}

/// Under bit 6 with PAGE_POISON and a non-zero poison_val, reported pages
/// are initialized to poison_val (not discarded, not kept as they were).
#[test]
fn reports_are_initialized_to_poison_val() {
    let d = start_daemon("poisonfill", &[]);
    let mut g = Guest::connect(&d, None);
    g.fe.set_config(
        12,
        VhostUserConfigFlags::WRITABLE,
        &0xaaaa_aaaau32.to_le_bytes(),
    )
    .unwrap();
    wait_counters(&d, |c| c["poison_val"] == 0xaaaa_aaaau32);
    let start = GPA + 4 * MIB;
    g.fill(start, MIB, 0x11);
    g.queues[REPORTING].push(&g.mem, &[(start, MIB as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert!(
        g.read(start, MIB).iter().all(|&b| b == 0xaa),
        "reported pages hold poison_val"
    );
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), MIB as u32);
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["poison_filled_bytes"], MIB, "{c}");
}

/// QEMU's generic vhost-user-device writes the whole 16-byte config space on
/// every guest write: the driver-writable fields must be taken from it.
#[test]
fn whole_config_write_takes_actual_and_poison_val() {
    let d = start_daemon("wholecfg", &[]);
    let mut g = Guest::connect(&d, None);
    let mut cfg = [0u8; 16];
    cfg[0..4].copy_from_slice(&5u32.to_le_bytes()); // num_pages (stale copy)
    cfg[4..8].copy_from_slice(&123u32.to_le_bytes()); // actual
    cfg[8..12].copy_from_slice(&9u32.to_le_bytes()); // free_page_hint_cmd_id
    cfg[12..16].copy_from_slice(&0xaaaa_aaaau32.to_le_bytes()); // poison_val
    g.fe.set_config(0, VhostUserConfigFlags::WRITABLE, &cfg)
        .unwrap();
    let c = wait_counters(&d, |c| c["actual"] == 123);
    assert_eq!(c["poison_val"], 0xaaaa_aaaau32, "{c}");
    assert_eq!(c["target"], 1000, "num_pages stays device-owned");
    let r = control(&d, r#"{"cmd":"get_config"}"#);
    assert_eq!(r["config"]["free_page_hint_cmd_id"], 0, "{r}");
    assert_eq!(c["counters"]["config_write_rejects"], 0, "{c}");
}

/// A kick on a ring that does not exist for the negotiated features (no
/// STATS_VQ: reporting is ring 2, ring 3 does not exist) is ignored and
/// counted; every other queue is still served.
#[test]
fn kick_on_a_queue_that_does_not_exist_is_ignored() {
    let d = start_daemon("nosuchq", &[]);
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            clear_features: 1 << 1, // STATS_VQ
            ..Opts::default()
        },
    );
    // setting up ring 3 may already count as a kick (the library kicks a
    // ring once when it gets its kick fd)
    std::thread::sleep(Duration::from_millis(200));
    let before = control(&d, r#"{"cmd":"get_counters"}"#)["counters"]["bad_queue_kicks"]
        .as_u64()
        .unwrap();
    g.kick(3);
    std::thread::sleep(Duration::from_millis(200));
    // reporting_vq is ring 2 now; lay the report out in ring 2's memory
    g.fill(GPA + 4 * MIB, MIB, 0xab);
    g.queues[2].push(&g.mem, &[(GPA + 4 * MIB, MIB as u32, true)]);
    g.kick(2);
    g.queues[2].wait_used(&g.mem, 1);
    assert!(g.read(GPA + 4 * MIB, MIB).iter().all(|&b| b == 0));
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["reports"], 1, "{c}");
    assert_eq!(c["counters"]["bad_queue_kicks"], before + 1, "{c}");
}

/// poison_val and actual are guest state: a reconnecting frontend does not
/// make the guest write them again, so they survive the reconnect. A device
/// reset clears them, and so does (for poison_val) a driver without
/// PAGE_POISON.
#[test]
fn poison_val_and_actual_survive_reconnect_until_reset() {
    let d = start_daemon("poison", &[]);
    {
        let mut g = Guest::connect(&d, None);
        g.fe.set_config(
            12,
            VhostUserConfigFlags::WRITABLE,
            &0xaaaa_aaaau32.to_le_bytes(),
        )
        .unwrap();
        g.fe.set_config(4, VhostUserConfigFlags::WRITABLE, &5u32.to_le_bytes())
            .unwrap();
        wait_counters(&d, |c| {
            c["poison_val"] == 0xaaaa_aaaau32 && c["actual"] == 5
        });
    }
    std::thread::sleep(Duration::from_millis(100));
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            protocol: VhostUserProtocolFeatures::RESET_DEVICE,
            ..Opts::default()
        },
    );
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["connections"], 2);
    assert_eq!(c["poison_val"], 0xaaaa_aaaau32, "poison_val kept: {c}");
    assert_eq!(c["actual"], 5, "actual kept: {c}");

    // a device reset puts the driver-written fields back to 0
    g.fe.reset_device().unwrap();
    let c = wait_counters(&d, |c| c["poison_val"] == 0);
    assert_eq!(c["actual"], 0, "{c}");
    drop(g);

    // a driver without PAGE_POISON: poison_val means nothing, it is cleared
    std::thread::sleep(Duration::from_millis(100));
    let mut g = Guest::connect(&d, None);
    g.fe.set_config(
        12,
        VhostUserConfigFlags::WRITABLE,
        &0x5555_5555u32.to_le_bytes(),
    )
    .unwrap();
    wait_counters(&d, |c| c["poison_val"] == 0x5555_5555u32);
    drop(g);
    std::thread::sleep(Duration::from_millis(100));
    let _g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            clear_features: 1 << 4, // PAGE_POISON
            ..Opts::default()
        },
    );
    let c = wait_counters(&d, |c| c["counters"]["connections"] == 4);
    assert_eq!(c["poison_val"], 0, "{c}");
}

/// Whether the page at `gpa` is marked in a vhost-user dirty log (one bit
/// per 4 KiB page of guest-physical address, LSB first).
fn log_bit(log: &File, gpa: u64) -> bool {
    use std::os::unix::fs::FileExt;
    let page = gpa >> 12;
    let mut b = [0u8; 1];
    log.read_exact_at(&mut b, page / 8).unwrap();
    b[0] & (1 << (page % 8)) != 0
}

/// Migration: with LOG_ALL and a shared log (LOG_SHMFD + SET_LOG_BASE),
/// every range the device discards or fills and every used-ring write is
/// marked dirty, so the frontend sends those pages again. Without a log,
/// nothing is acknowledged as initialized. Turning LOG_ALL on does not drop
/// the held stats buffer.
#[test]
fn dirty_log_records_discards_fills_and_used_rings() {
    let d = start_daemon("dirtylog", &[]);
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            log_all: true,
            protocol: VhostUserProtocolFeatures::LOG_SHMFD,
            ..Opts::default()
        },
    );
    let log_size = ((GPA + MEM) >> 12).div_ceil(8);
    // sealed, as QEMU shares its log (an unsealed memfd is refused)
    let log = sealed_memfd(log_size, 0);
    g.fe.set_log_base(
        0,
        Some(vhost::VhostUserDirtyLogRegion {
            mmap_size: log_size,
            mmap_offset: 0,
            mmap_handle: log.as_raw_fd(),
        }),
    )
    .unwrap();

    // a report: discarded (memfd) and logged
    let start = GPA + 4 * MIB;
    g.fill(start, 2 * MIB, 0xab);
    assert!(!log_bit(&log, start));
    g.queues[REPORTING].push(&g.mem, &[(start, (2 * MIB) as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), (2 * MIB) as u32);
    for p in (start..start + 2 * MIB).step_by(4096) {
        assert!(log_bit(&log, p), "discarded page {p:#x} logged");
    }
    assert!(!log_bit(&log, start + 2 * MIB), "neighbour not logged");
    assert!(
        log_bit(&log, g.queues[REPORTING].used),
        "used ring write logged"
    );

    // an inflate: the page and the bitmap the device wrote are logged
    let data = GPA + 0x10_0000;
    let page = GPA + 9 * MIB;
    g.mem
        .write_obj(((page >> 12) as u32).to_le_bytes(), GuestAddress(data))
        .unwrap();
    let bitmap = GPA + 0x11_0000;
    g.queues[INFLATE].push(&g.mem, &[(data, 4, false), (bitmap, 1, true)]);
    g.kick(INFLATE);
    g.queues[INFLATE].wait_used(&g.mem, 1);
    assert_eq!(g.mem.read_obj::<u8>(GuestAddress(bitmap)).unwrap(), 1);
    assert!(log_bit(&log, page), "inflated page logged");
    assert!(log_bit(&log, bitmap), "bitmap write logged");
    assert!(!log_bit(&log, data), "the PFN array was only read");

    // the held stats buffer survives LOG_ALL going off and on again
    let sbuf = GPA + 0x18_0000;
    let st = [4u8, 0, 1, 0, 0, 0, 0, 0, 0, 0];
    g.mem.write_slice(&st, GuestAddress(sbuf)).unwrap();
    g.queues[STATS].push(&g.mem, &[(sbuf, st.len() as u32, false)]);
    g.kick(STATS);
    wait_counters(&d, |c| c["counters"]["stats_updates"] == 1);
    let f = g.fe.get_features().unwrap();
    g.fe.set_features(f & !LOG_ALL).unwrap();
    g.fe.set_features(f).unwrap();
    g.fe.get_features().unwrap(); // round trip
    let s = control(&d, r#"{"cmd":"get_stats","wait_ms":50}"#);
    assert_eq!(s["ok"], true);
    g.queues[STATS].wait_used(&g.mem, 1);
    assert!(log_bit(&log, g.queues[STATS].used));
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["dirty_log_misses"], 0, "{c}");
    drop(g);

    // LOG_ALL without a shared log: the device cannot tell the frontend
    // what it changed, so nothing is acknowledged as initialized
    std::thread::sleep(Duration::from_millis(100));
    let mut g = Guest::connect_opts(
        &d,
        None,
        &Opts {
            log_all: true,
            ..Opts::default()
        },
    );
    g.fill(start, MIB, 0xab);
    g.queues[REPORTING].push(&g.mem, &[(start, MIB as u32, true)]);
    g.kick(REPORTING);
    g.queues[REPORTING].wait_used(&g.mem, 1);
    assert_eq!(g.queues[REPORTING].used_len(&g.mem, 0), 0);
    let c = control(&d, r#"{"cmd":"get_counters"}"#);
    assert_eq!(c["counters"]["dirty_log_misses"], 1, "{c}");
    assert_eq!(c["counters"]["reports_not_initialized"], 1, "{c}");
}

/// SET_CONFIG payload: offset, size, flags, then the bytes.
fn set_config_payload(offset: u32, flags: u32, bytes: &[u8]) -> Vec<u8> {
    let mut p = offset.to_le_bytes().to_vec();
    p.extend_from_slice(&u32::try_from(bytes.len()).unwrap().to_le_bytes());
    p.extend_from_slice(&flags.to_le_bytes());
    p.extend_from_slice(bytes);
    p
}

/// On a migration's destination QEMU hands the backend the configuration
/// space of the source before the device starts (SET_CONFIG, flags 1 =
/// `VHOST_SET_CONFIG_TYPE_MIGRATION`): the target comes with it, as do
/// `actual` and `poison_val`. A driver's write (flags 0) still cannot set
/// the target.
#[test]
fn migrated_config_restores_the_target() {
    let d = start_daemon("migcfg", &[]);
    let raw = RawFrontend::connect(&d).unwrap();
    raw.handshake(VhostUserProtocolFeatures::empty()).unwrap();
    let mut cfg = [0u8; 16];
    cfg[0..4].copy_from_slice(&4242u32.to_le_bytes()); // num_pages
    cfg[4..8].copy_from_slice(&17u32.to_le_bytes()); // actual
    cfg[12..16].copy_from_slice(&0x5555_5555u32.to_le_bytes()); // poison_val
    let ack = raw.acked(req::SET_CONFIG, &set_config_payload(0, 1, &cfg), &[]);
    assert!(matches!(ack, Ok(0)), "{ack:?}");
    let c = wait_counters(&d, |c| c["actual"] == 17);
    assert_eq!(c["target"], 4242, "{c}");
    assert_eq!(c["poison_val"], 0x5555_5555u32, "{c}");

    cfg[0..4].copy_from_slice(&9u32.to_le_bytes());
    cfg[4..8].copy_from_slice(&18u32.to_le_bytes());
    let ack = raw.acked(req::SET_CONFIG, &set_config_payload(0, 0, &cfg), &[]);
    assert!(matches!(ack, Ok(0)), "{ack:?}");
    let c = wait_counters(&d, |c| c["actual"] == 18);
    assert_eq!(c["target"], 4242, "a driver's write set the target: {c}");
}
