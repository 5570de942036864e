//! Reports in flight, in-process: the backend is driven the way the
//! library's vring thread drives it (`handle_event` on one thread), with a
//! discarder test double that blocks on one range until the test lets it go.
//!
//! * inflate and stats are served while a report is being discarded;
//! * a report is acknowledged only after every one of its ranges is done;
//! * GET_VRING_BASE (`stop_vring`) and RESET_DEVICE wait for the reports in
//!   flight; after a reset (vrings disabled) the ack is not written.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use vhost_user_balloon::backend::{BalloonBackend, DeviceFeatures, DeviceState};
use vhost_user_balloon::discard::{fill_pattern, DiscardError, Discarded, Discarder, GuestMem};
use vhost_user_balloon::ranges::GuestRange;
use vhost_user_balloon::spec::{self, bit};
use vm_memory::{Bytes, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;

type GM = GuestMemoryAtomic<GuestMem>;

const MEM: u64 = 16 << 20;
const QSIZE: u16 = 16;
const INFLATE: usize = 0;
const STATS: usize = 2;
const REPORTING: usize = 3;
/// Reported ranges start here (the rings live below).
const BASE: u64 = 4 << 20;
const WAIT: Duration = Duration::from_secs(5);

/// Discards like `RecordingDiscarder` (zero-fill through guest memory), but
/// a discard of `block_gpa` tells the test (`entered`) and waits until the
/// gate opens.
struct GateDiscarder {
    block_gpa: u64,
    open: Mutex<bool>,
    cond: Condvar,
    entered: Mutex<Sender<GuestRange>>,
    calls: Mutex<Vec<GuestRange>>,
}

impl GateDiscarder {
    fn new(block_gpa: u64) -> (Arc<Self>, Receiver<GuestRange>) {
        let (tx, rx) = mpsc::channel();
        let d = Arc::new(Self {
            block_gpa,
            open: Mutex::new(false),
            cond: Condvar::new(),
            entered: Mutex::new(tx),
            calls: Mutex::new(Vec::new()),
        });
        (d, rx)
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cond.notify_all();
    }
}

impl Discarder for GateDiscarder {
    fn releases_memory(&self) -> bool {
        true
    }

    fn discard(&self, mem: &GuestMem, range: GuestRange) -> Result<Discarded, DiscardError> {
        if range.gpa == self.block_gpa {
            let _ = self.entered.lock().unwrap().send(range);
            let mut open = self.open.lock().unwrap();
            while !*open {
                open = self.cond.wait(open).unwrap();
            }
        }
        fill_pattern(mem, range, 0)?;
        self.calls.lock().unwrap().push(range);
        Ok(Discarded {
            discarded: range.len,
            rest: Vec::new(),
        })
    }
}

/// Opens the gate when the test ends, failed or not, so that no thread
/// stays blocked.
struct OpenOnDrop(Arc<GateDiscarder>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// A split ring laid out by hand: descriptor table, avail and used ring,
/// one 4 KiB page each, queue `i` at `i * 16 KiB`.
struct Ring {
    desc: u64,
    avail: u64,
    used: u64,
    next_desc: u16,
    avail_idx: u16,
}

impl Ring {
    fn new(i: usize) -> Self {
        let base = i as u64 * 0x4000;
        Self {
            desc: base,
            avail: base + 0x1000,
            used: base + 0x2000,
            next_desc: 0,
            avail_idx: 0,
        }
    }

    fn push(&mut self, mem: &GuestMem, bufs: &[(u64, u32, bool)]) {
        let head = self.next_desc;
        for (i, (addr, len, w)) in bufs.iter().enumerate() {
            let idx = self.next_desc;
            let mut flags = if *w { 2u16 } else { 0 };
            if i + 1 < bufs.len() {
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
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
    }

    fn used_idx(&self, mem: &GuestMem) -> u16 {
        mem.read_obj(GuestAddress(self.used + 2)).unwrap()
    }

    fn used_len(&self, mem: &GuestMem, i: u16) -> u32 {
        mem.read_obj(GuestAddress(self.used + 8 + u64::from(i % QSIZE) * 8))
            .unwrap()
    }

    fn wait_used(&self, mem: &GuestMem, want: u16) {
        let t = Instant::now();
        while self.used_idx(mem) != want {
            assert!(
                t.elapsed() < WAIT,
                "used idx stuck at {}",
                self.used_idx(mem)
            );
            thread::sleep(Duration::from_millis(2));
        }
    }
}

struct Dev {
    backend: BalloonBackend,
    state: Arc<DeviceState>,
    mem: GuestMem,
    vrings: Vec<VringRwLock<GM>>,
    rings: Vec<Ring>,
}

/// A backend with every feature but LOG_ALL negotiated, guest memory
/// shared, four rings enabled.
fn device(d: Arc<dyn Discarder>) -> Dev {
    device_with(d, None)
}

/// As [`device`], with `threads` discard workers (None: the default).
fn device_with(d: Arc<dyn Discarder>, threads: Option<usize>) -> Dev {
    let mem = GuestMem::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    let atomic = GuestMemoryAtomic::new(mem.clone());
    let state = Arc::new(DeviceState::new(0).unwrap());
    let f = DeviceFeatures {
        init_reported: true,
        init_on_inflate: true,
        ..DeviceFeatures::default()
    };
    let backend = match threads {
        None => BalloonBackend::new(state.clone(), d, f),
        Some(n) => BalloonBackend::with_discard_threads(state.clone(), d, f, n).unwrap(),
    };
    let features = backend.features() & !bit(spec::F_LOG_ALL);
    backend.acked_features(features);
    backend.update_memory(atomic.clone()).unwrap();
    let mut vrings = Vec::new();
    let mut rings = Vec::new();
    for i in 0..4 {
        let r = Ring::new(i);
        let v = VringRwLock::new(atomic.clone(), QSIZE).unwrap();
        v.set_queue_size(QSIZE);
        v.set_queue_info(r.desc, r.avail, r.used).unwrap();
        v.set_queue_ready(true);
        v.set_enabled(true);
        vrings.push(v);
        rings.push(r);
    }
    Dev {
        backend,
        state,
        mem,
        vrings,
        rings,
    }
}

fn kick(b: &BalloonBackend, vrings: &[VringRwLock<GM>], q: usize) {
    b.handle_event(q as u16, EventSet::IN, vrings, 0).unwrap();
}

/// Posts a report of `n` 64 KiB ranges, 128 KiB apart, from `BASE`, filled
/// with 0xab first.
fn post_report(dev: &mut Dev, n: u64) -> Vec<(u64, u32, bool)> {
    let descs: Vec<(u64, u32, bool)> = (0..n)
        .map(|i| (BASE + i * 0x2_0000, 0x1_0000, true))
        .collect();
    for (gpa, len, _) in &descs {
        dev.mem
            .write_slice(&vec![0xab; *len as usize], GuestAddress(*gpa))
            .unwrap();
    }
    dev.rings[REPORTING].push(&dev.mem, &descs);
    descs
}

/// A counter of `get_counters` by name.
fn counter(dev: &Dev, name: &str) -> u64 {
    let v = serde_json::to_value(dev.state.metrics.snapshot()).unwrap();
    v[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {name}"))
}

fn wait_counter(dev: &Dev, name: &str, want: u64) {
    let t = Instant::now();
    while counter(dev, name) != want {
        assert!(t.elapsed() < WAIT, "{name} = {}", counter(dev, name));
        thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn inflate_and_stats_are_served_while_a_report_is_in_flight() {
    let (gate, entered) = GateDiscarder::new(BASE);
    let _open = OpenOnDrop(gate.clone());
    let mut dev = device(gate.clone());
    post_report(&mut dev, 4);
    // inflate: one PFN, no bitmap room needed for this check beyond 1 byte
    let pfns = GuestAddress(0x10_0000);
    let page = 8u64 << 20;
    dev.mem
        .write_slice(&((page >> 12) as u32).to_le_bytes(), pfns)
        .unwrap();
    dev.rings[INFLATE].push(&dev.mem, &[(pfns.0, 4, false), (0x10_0800, 1, true)]);
    // stats: one tag/value pair
    let sbuf = 0x18_0000u64;
    let mut st = 4u16.to_le_bytes().to_vec();
    st.extend_from_slice(&123u64.to_le_bytes());
    dev.mem.write_slice(&st, GuestAddress(sbuf)).unwrap();
    dev.rings[STATS].push(&dev.mem, &[(sbuf, st.len() as u32, false)]);

    // The vring thread: reporting kick, then inflate and stats kicks.
    let (served_tx, served) = mpsc::channel();
    let (b, v) = (dev.backend.clone(), dev.vrings.clone());
    let vring_thread = thread::spawn(move || {
        for q in [REPORTING, INFLATE, STATS] {
            kick(&b, &v, q);
            let _ = served_tx.send(q);
        }
    });
    entered
        .recv_timeout(WAIT)
        .expect("discard of the report started");
    for q in [REPORTING, INFLATE, STATS] {
        assert_eq!(
            served.recv_timeout(Duration::from_secs(2)),
            Ok(q),
            "queue {q} not served while a report was in flight \
             (discards block the vring thread)"
        );
    }
    assert_eq!(dev.rings[INFLATE].used_idx(&dev.mem), 1, "inflate acked");
    assert!(dev.state.stats().is_some(), "stats received");
    assert_eq!(
        dev.rings[REPORTING].used_idx(&dev.mem),
        0,
        "the report is not acked while a range is being discarded"
    );
    assert_eq!(counter(&dev, "reports_in_flight"), 1);
    thread::sleep(Duration::from_millis(200));
    gate.open();
    dev.rings[REPORTING].wait_used(&dev.mem, 1);
    assert_eq!(dev.rings[REPORTING].used_len(&dev.mem, 0), 4 * 0x1_0000);
    vring_thread.join().unwrap();
    wait_counter(&dev, "report_acks", 1);
    assert_eq!(counter(&dev, "reports_in_flight"), 0);
    assert!(
        counter(&dev, "report_ack_ns_sum") >= 200_000_000,
        "report -> ack latency covers the blocked discard"
    );
}

#[test]
fn a_report_is_acked_only_after_all_its_ranges_are_discarded() {
    let blocked = BASE + 2 * 0x2_0000; // the third of four ranges
    let (gate, entered) = GateDiscarder::new(blocked);
    let _open = OpenOnDrop(gate.clone());
    let mut dev = device(gate.clone());
    let descs = post_report(&mut dev, 4);
    let (b, v) = (dev.backend.clone(), dev.vrings.clone());
    let t = thread::spawn(move || kick(&b, &v, REPORTING));
    entered.recv_timeout(WAIT).expect("discard started");
    // the other ranges may finish meanwhile; the ack must wait
    thread::sleep(Duration::from_millis(200));
    assert_eq!(dev.rings[REPORTING].used_idx(&dev.mem), 0, "acked early");
    gate.open();
    dev.rings[REPORTING].wait_used(&dev.mem, 1);
    // by the time the ack is visible, every range was discarded
    assert_eq!(gate.calls.lock().unwrap().len(), 4);
    assert_eq!(dev.rings[REPORTING].used_len(&dev.mem, 0), 4 * 0x1_0000);
    for (gpa, len, _) in descs {
        let mut buf = vec![1u8; len as usize];
        dev.mem.read_slice(&mut buf, GuestAddress(gpa)).unwrap();
        assert!(buf.iter().all(|&x| x == 0), "{gpa:#x} discarded");
    }
    t.join().unwrap();
    assert_eq!(counter(&dev, "discarded_bytes"), 4 * 0x1_0000);
}

#[test]
fn stop_vring_completes_the_reports_in_flight() {
    let (gate, entered) = GateDiscarder::new(BASE);
    let _open = OpenOnDrop(gate.clone());
    let mut dev = device(gate.clone());
    post_report(&mut dev, 2);
    let (b, v) = (dev.backend.clone(), dev.vrings.clone());
    let t = thread::spawn(move || kick(&b, &v, REPORTING));
    entered.recv_timeout(WAIT).expect("discard started");
    // GET_VRING_BASE: the library marks the queue not ready, then calls
    // stop_vring, then reads the ring state.
    dev.vrings[REPORTING].set_queue_ready(false);
    let (done_tx, done) = mpsc::channel();
    let b = dev.backend.clone();
    let stopper = thread::spawn(move || {
        b.stop_vring(REPORTING as u32).unwrap();
        let _ = done_tx.send(());
    });
    assert!(
        done.recv_timeout(Duration::from_millis(200)).is_err(),
        "stop_vring returned while a discard was in flight"
    );
    gate.open();
    done.recv_timeout(WAIT).expect("stop_vring returned");
    assert_eq!(
        dev.rings[REPORTING].used_idx(&dev.mem),
        1,
        "the report popped before GET_VRING_BASE is in the used ring"
    );
    stopper.join().unwrap();
    t.join().unwrap();
}

#[test]
fn reset_waits_for_discards_and_drops_their_ack() {
    let (gate, entered) = GateDiscarder::new(BASE);
    let _open = OpenOnDrop(gate.clone());
    let mut dev = device(gate.clone());
    post_report(&mut dev, 2);
    let (b, v) = (dev.backend.clone(), dev.vrings.clone());
    let t = thread::spawn(move || kick(&b, &v, REPORTING));
    entered.recv_timeout(WAIT).expect("discard started");
    // RESET_DEVICE: the library disables every vring, then calls
    // reset_device.
    for v in &dev.vrings {
        v.set_enabled(false);
    }
    let (done_tx, done) = mpsc::channel();
    let b = dev.backend.clone();
    let resetter = thread::spawn(move || {
        b.reset_device();
        let _ = done_tx.send(());
    });
    assert!(
        done.recv_timeout(Duration::from_millis(200)).is_err(),
        "reset returned while a discard was in flight"
    );
    gate.open();
    done.recv_timeout(WAIT).expect("reset returned");
    assert_eq!(gate.calls.lock().unwrap().len(), 2, "discards finished");
    assert_eq!(
        dev.rings[REPORTING].used_idx(&dev.mem),
        0,
        "no ack written into a disabled ring"
    );
    assert_eq!(counter(&dev, "report_acks_dropped"), 1);
    resetter.join().unwrap();
    t.join().unwrap();
}

#[test]
fn without_workers_the_report_is_acked_before_the_kick_returns() {
    let (gate, _entered) = GateDiscarder::new(u64::MAX); // never blocks
    let mut dev = device_with(gate.clone(), Some(0));
    assert_eq!(dev.backend.discard_threads(), 0);
    post_report(&mut dev, 3);
    kick(&dev.backend, &dev.vrings, REPORTING);
    assert_eq!(dev.rings[REPORTING].used_idx(&dev.mem), 1);
    assert_eq!(dev.rings[REPORTING].used_len(&dev.mem, 0), 3 * 0x1_0000);
    assert_eq!(gate.calls.lock().unwrap().len(), 3);
    assert_eq!(counter(&dev, "report_acks"), 1);
}
