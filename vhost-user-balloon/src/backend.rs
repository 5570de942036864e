//! The `VhostUserBackend` implementation: one `process_<queue>()` per
//! virtqueue, config space, and the state shared with the control socket.

use std::io;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use log::{debug, info, warn, Level};
use serde::Serialize;
use thiserror::Error;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::Backend;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend,
    GuestMemoryLoadGuard, GuestMemoryRegion,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::chain::{Chain, ChainError};
use crate::discard::{self, treat_range, Discarder, GuestMem, LogBitmap, Treatment};
use crate::metrics::{add, bump, log_sparse, Metrics, MetricsSnapshot};
use crate::pool::{self, DiscardPool, InFlight, PoolError};
use crate::ranges::{self, BalloonConfig, GuestRange, Plan, RegionInfo, RejectReason, Stat};
use crate::shim::BackendChannel;
use crate::spec::{self, bit, has, QueueRole, SpecError, MAX_QUEUES, PAGE_SIZE};

/// Queue size limit advertised to the frontend (UML uses 256 and never asks).
pub const MAX_QUEUE_SIZE: usize = 1024;
/// Epoll id of the "operator asked for fresh stats" eventfd. Ids
/// `0..MAX_QUEUES` are the vrings, `MAX_QUEUES` is the library's exit event.
pub const STATS_REQUEST_EVENT: u16 = MAX_QUEUES as u16 + 1;
/// Upper bound of a PFN array we read (Linux sends at most 256 PFNs = 1 KiB).
pub const MAX_PFN_BYTES: usize = 256 * 1024;
/// Upper bound of a stats buffer.
pub const MAX_STATS_BYTES: usize = 64 * 1024;
/// Upper bound of descriptors in one report (a chain cannot be longer than
/// its ring: indirect descriptors are refused).
pub const MAX_REPORT_DESCS: usize = MAX_QUEUE_SIZE;

type GM = GuestMemoryAtomic<GuestMem>;
type Mem = GuestMemoryLoadGuard<GuestMem>;

/// Error of this module.
#[derive(Debug, Error)]
pub enum BackendError {
    /// An event arrived before SET_MEM_TABLE.
    #[error("no guest memory table yet")]
    NoMemory,
    /// Virtqueue access failed.
    #[error("virtqueue error: {0}")]
    Queue(#[from] virtio_queue::Error),
    /// Queue index does not exist with the negotiated features.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Signalling the guest failed.
    #[error("failed to signal used queue: {0}")]
    Signal(io::Error),
    /// An event id we never registered.
    #[error("unexpected event {0} (evset {1:?})")]
    UnexpectedEvent(u16, EventSet),
    /// A descriptor pointed outside guest memory or was otherwise unusable.
    #[error("bad descriptor chain: {0}")]
    BadChain(String),
    /// Guest wrote an invalid part of config space.
    #[error("config write rejected: {0}")]
    Config(#[from] ranges::RangeError),
    /// Notifying the frontend of a config change failed.
    #[error("config change notification failed: {0}")]
    Notify(io::Error),
    /// Reading the stats request eventfd failed.
    #[error("eventfd error: {0}")]
    EventFd(io::Error),
    /// The discard worker pool could not be started.
    #[error(transparent)]
    Pool(#[from] PoolError),
}

impl From<BackendError> for io::Error {
    fn from(e: BackendError) -> Self {
        io::Error::other(e)
    }
}

/// What the device offers, chosen by the operator (see `cli`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceFeatures {
    /// Offer VIRTIO_BALLOON_F_MUST_TELL_HOST.
    pub must_tell_host: bool,
    /// Offer VIRTIO_BALLOON_F_STATS_VQ.
    pub stats: bool,
    /// Offer VIRTIO_BALLOON_F_DEFLATE_ON_OOM.
    pub deflate_on_oom: bool,
    /// Offer VIRTIO_BALLOON_F_PAGE_POISON.
    pub page_poison: bool,
    /// Offer VIRTIO_BALLOON_F_REPORTING.
    pub reporting: bool,
    /// Offer the proposed bit 6 (DEVICE_INIT_REPORTED), if the discarder
    /// releases memory and reporting is offered. Experimental: off unless
    /// asked for (`--x-device-init-reported`).
    pub init_reported: bool,
    /// Offer the proposed bit 7 (DEVICE_INIT_ON_INFLATE), if the discarder
    /// releases memory. Experimental: off unless asked for
    /// (`--x-device-init-on-inflate`).
    pub init_on_inflate: bool,
    /// Offer VHOST_USER_PROTOCOL_F_BACKEND_REQ (config change notifications).
    pub backend_req: bool,
    /// Offer VHOST_F_LOG_ALL with VHOST_USER_PROTOCOL_F_LOG_SHMFD (dirty
    /// logging for migration). Never one without the other.
    pub dirty_log: bool,
}

impl Default for DeviceFeatures {
    fn default() -> Self {
        Self {
            must_tell_host: true,
            stats: true,
            deflate_on_oom: true,
            page_poison: true,
            reporting: true,
            init_reported: false,
            init_on_inflate: false,
            backend_req: true,
            dirty_log: true,
        }
    }
}

impl DeviceFeatures {
    /// Virtio feature bits offered on GET_FEATURES. Bits 6 and 7 need a
    /// discarder that releases memory (`--discard none` keeps every page
    /// as it is, so it does not offer them).
    pub fn virtio_features(&self, releases_memory: bool) -> u64 {
        let mut f = bit(spec::F_VERSION_1) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let mut set = |on: bool, b: u32| {
            if on {
                f |= bit(b);
            }
        };
        set(self.must_tell_host, spec::F_MUST_TELL_HOST);
        set(self.stats, spec::F_STATS_VQ);
        set(self.deflate_on_oom, spec::F_DEFLATE_ON_OOM);
        set(self.page_poison, spec::F_PAGE_POISON);
        set(self.reporting, spec::F_REPORTING);
        set(
            self.init_reported && self.reporting && releases_memory,
            spec::F_DEVICE_INIT_REPORTED,
        );
        set(
            self.init_on_inflate && releases_memory,
            spec::F_DEVICE_INIT_ON_INFLATE,
        );
        // LOG_ALL only together with LOG_SHMFD (protocol_features()): a
        // frontend that migrates must get every discard and fill in its log,
        // or the destination keeps stale pages the guest was told are
        // initialized.
        set(self.dirty_log, spec::F_LOG_ALL);
        f
    }

    /// vhost-user protocol features offered.
    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        let mut p = VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::RESET_DEVICE;
        if self.backend_req {
            p |= VhostUserProtocolFeatures::BACKEND_REQ;
        }
        if self.dirty_log {
            p |= VhostUserProtocolFeatures::LOG_SHMFD;
        }
        p
    }
}

/// The latest statistics the guest sent.
#[derive(Clone, Debug, Serialize)]
pub struct StatsRecord {
    /// Incremented on every stats buffer.
    pub generation: u64,
    /// Seconds since the epoch when received.
    pub received_unix: f64,
    /// The raw statistics.
    pub stats: Vec<Stat>,
}

#[derive(Default)]
struct SharedInner {
    config: BalloonConfig,
    acked_features: u64,
    offered_features: u64,
    connected: bool,
    stats: Option<StatsRecord>,
    backend_req: Option<Arc<BackendChannel>>,
}

/// Device state that outlives a frontend connection and is shared with the
/// control socket.
pub struct DeviceState {
    /// Counters.
    pub metrics: Metrics,
    target: AtomicU32,
    acked_protocol: AtomicU64,
    inner: Mutex<SharedInner>,
    stats_cond: Condvar,
    stats_request: EventFd,
}

/// Result of `set_target`.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct TargetUpdate {
    /// New target in 4 KiB pages.
    pub pages: u32,
    /// Whether the frontend was notified (config change message).
    pub notified: bool,
}

impl DeviceState {
    /// Creates the state with an initial balloon target.
    pub fn new(initial_target: u32) -> io::Result<Self> {
        Ok(Self {
            metrics: Metrics::default(),
            target: AtomicU32::new(initial_target),
            acked_protocol: AtomicU64::new(0),
            inner: Mutex::new(SharedInner::default()),
            stats_cond: Condvar::new(),
            stats_request: EventFd::new(EFD_NONBLOCK)?,
        })
    }

    fn lock(&self) -> MutexGuard<'_, SharedInner> {
        // A poisoned lock only means another thread panicked while holding
        // it; the data (plain values) is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The eventfd the control socket writes to ask for fresh stats.
    pub fn stats_request_fd(&self) -> &EventFd {
        &self.stats_request
    }

    /// Current balloon target (pages).
    pub fn target(&self) -> u32 {
        self.target.load(Ordering::Relaxed)
    }

    /// Current config space as the driver sees it.
    pub fn config(&self) -> BalloonConfig {
        let mut c = self.lock().config;
        c.num_pages = self.target();
        c
    }

    /// The config space and the counters as of one moment. A config
    /// write, taken or rejected, changes the one or bumps the other under
    /// the state lock; reading both under it keeps a reply from counting a
    /// rejected write that came after the config it shows.
    pub fn config_and_counters(&self) -> (BalloonConfig, MetricsSnapshot) {
        let g = self.lock();
        let mut c = g.config;
        c.num_pages = self.target();
        (c, self.metrics.snapshot())
    }

    /// Negotiated virtio features (0 when no frontend is connected).
    pub fn acked_features(&self) -> u64 {
        self.lock().acked_features
    }

    /// Virtio features offered to the current/last frontend.
    pub fn offered_features(&self) -> u64 {
        self.lock().offered_features
    }

    /// Negotiated vhost-user protocol features (seen by the connection shim).
    pub fn acked_protocol_features(&self) -> u64 {
        self.acked_protocol.load(Ordering::Relaxed)
    }

    /// Records SET_PROTOCOL_FEATURES (called by the connection shim).
    pub fn set_acked_protocol_features(&self, f: u64) {
        self.acked_protocol.store(f, Ordering::Relaxed);
    }

    /// Whether a frontend is connected.
    pub fn connected(&self) -> bool {
        self.lock().connected
    }

    /// Whether the device initializes reported pages (bit 6 negotiated) and
    /// inflated pages (bit 7 negotiated and no non-zero `poison_val`: then
    /// inflated pages are released and left out of the bitmap).
    pub fn init_guarantees(&self) -> (bool, bool) {
        let g = self.lock();
        let f = g.acked_features;
        let poisoned = has(f, spec::F_PAGE_POISON) && g.config.poison_val != 0;
        (
            has(f, spec::F_DEVICE_INIT_REPORTED),
            has(f, spec::F_DEVICE_INIT_ON_INFLATE) && !poisoned,
        )
    }

    /// The value pages are initialized to: `poison_val` when PAGE_POISON
    /// is negotiated, zero otherwise.
    pub fn init_pattern(&self) -> u32 {
        let g = self.lock();
        if has(g.acked_features, spec::F_PAGE_POISON) {
            g.config.poison_val
        } else {
            0
        }
    }

    /// Takes the target of a migration's SET_CONFIG (the source's
    /// `num_pages`): the destination starts from the balloon the guest
    /// had. The driver-written fields of the same message go the usual
    /// way (`set_config`). Nothing is sent to the frontend: the guest
    /// already has this configuration.
    pub fn restore_migrated_config(&self, offset: u32, bytes: &[u8]) {
        let at = usize::try_from(offset)
            .ok()
            .and_then(|o| spec::CFG_NUM_PAGES.checked_sub(o));
        let field = at
            .and_then(|i| bytes.get(i..i.checked_add(4)?))
            .and_then(|b| <[u8; 4]>::try_from(b).ok());
        if let Some(b) = field {
            let pages = u32::from_le_bytes(b);
            self.target.store(pages, Ordering::Relaxed);
            info!("balloon target {pages} pages taken from the migrated configuration");
        }
    }

    /// Sets the balloon target and tells the frontend (config change
    /// message over the backend request channel) when possible.
    pub fn set_target(&self, pages: u32) -> Result<TargetUpdate, BackendError> {
        self.target.store(pages, Ordering::Relaxed);
        let req = self.lock().backend_req.clone();
        let notified = match req {
            Some(b) => match b.send_config_change() {
                Ok(()) => {
                    add(&self.metrics.config_notifications, 1);
                    true
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // The channel is full of config changes the frontend
                    // has not read: when it reads them it reads the config,
                    // and with it this target.
                    let n = bump(&self.metrics.config_notifications_dropped);
                    log_sparse(
                        Level::Warn,
                        n,
                        format_args!(
                            "frontend does not read its backend request channel: \
                             config change for target {pages} not sent"
                        ),
                    );
                    false
                }
                Err(e) => return Err(BackendError::Notify(e)),
            },
            None => false,
        };
        info!("balloon target set to {pages} pages (frontend notified: {notified})");
        Ok(TargetUpdate { pages, notified })
    }

    /// Latest stats, if any.
    pub fn stats(&self) -> Option<StatsRecord> {
        self.lock().stats.clone()
    }

    /// Asks the backend to hand the stats buffer back to the guest so that it
    /// sends fresh statistics; then waits up to `wait` for them. Returns the
    /// latest stats (fresh ones if they arrived in time).
    pub fn request_stats(&self, wait: Duration) -> Result<Option<StatsRecord>, BackendError> {
        let start_gen = self.lock().stats.as_ref().map_or(0, |s| s.generation);
        self.stats_request.write(1).map_err(BackendError::EventFd)?;
        let deadline = Instant::now() + wait;
        let mut g = self.lock();
        loop {
            if g.stats.as_ref().is_some_and(|s| s.generation > start_gen) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let (ng, _) = self
                .stats_cond
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|p| p.into_inner());
            g = ng;
        }
        Ok(g.stats.clone())
    }

    fn store_stats(&self, stats: Vec<Stat>) {
        let mut g = self.lock();
        let generation = g.stats.as_ref().map_or(0, |s| s.generation) + 1;
        let received_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        g.stats = Some(StatsRecord {
            generation,
            received_unix,
            stats,
        });
        drop(g);
        self.stats_cond.notify_all();
    }

    /// Called when a new frontend connects: per-connection state is reset.
    /// The target, the counters and the driver-written config fields
    /// (`actual`, `poison_val`) are kept: they are guest state, and a
    /// frontend that reconnects (QEMU with a reconnecting chardev) does not
    /// make the guest write them again.
    pub fn connection_started(&self, offered: u64) {
        let mut g = self.lock();
        g.acked_features = 0;
        g.offered_features = offered;
        g.connected = true;
        g.backend_req = None;
        drop(g);
        self.acked_protocol.store(0, Ordering::Relaxed);
        add(&self.metrics.connections, 1);
    }

    /// Records a SET_FEATURES. `poison_val` only means something with
    /// PAGE_POISON, and a driver that negotiates PAGE_POISON writes it while
    /// it probes (before or after this message, depending on the frontend:
    /// QEMU forwards the config write before it starts the backend), so it is
    /// cleared only when the new features lack PAGE_POISON.
    /// Returns whether `poison_val` was cleared.
    pub fn features_negotiated(&self, features: u64) -> bool {
        let mut g = self.lock();
        g.acked_features = features;
        let clear = !has(features, spec::F_PAGE_POISON) && g.config.poison_val != 0;
        if clear {
            g.config.poison_val = 0;
        }
        clear
    }

    /// A device reset (VHOST_USER_RESET_DEVICE): the driver-written config
    /// fields go back to their initial value; the driver that follows writes
    /// them again.
    pub fn device_reset(&self) {
        let mut g = self.lock();
        g.acked_features = 0;
        g.config.actual = 0;
        g.config.poison_val = 0;
    }

    /// Records the frontend's backend request channel (from the shim).
    pub fn set_backend_channel(&self, ch: Arc<BackendChannel>) {
        self.lock().backend_req = Some(ch);
    }

    /// Called when the frontend went away.
    pub fn connection_closed(&self) {
        let mut g = self.lock();
        g.connected = false;
        g.backend_req = None;
    }
}

struct Inner {
    state: Arc<DeviceState>,
    discarder: Arc<dyn Discarder>,
    features: u64,
    protocol: VhostUserProtocolFeatures,
    mem: Mutex<Option<GM>>,
    acked: AtomicU64,
    stats_head: Mutex<Option<u16>>,
    /// Messages of this connection that are logged at `info` sparsely (a
    /// frontend can repeat them at will): SET_FEATURES, SET_MEM_TABLE,
    /// RESET_DEVICE, guest writes of `poison_val`.
    negotiations: AtomicU64,
    mem_tables: AtomicU64,
    resets: AtomicU64,
    poison_writes: AtomicU64,
    /// Treats reported ranges off the vring thread (see `pool.rs` for what
    /// happens to in-flight reports on reset, stop and memory changes).
    pool: DiscardPool,
}

/// What treating one range needs, without the backend itself (a task must
/// not keep the backend, and so the pool, alive from a worker).
#[derive(Clone)]
struct TreatCtx {
    state: Arc<DeviceState>,
    discarder: Arc<dyn Discarder>,
    /// LOG_ALL negotiated when the chain was popped.
    migrating: bool,
}

/// What went wrong while the ranges of one chain were treated: counted in
/// the metrics range by range, logged once for the chain.
#[derive(Debug, Default)]
struct TreatIssues {
    /// Ranges with a failed discard or fill.
    errors: u64,
    /// Ranges changed while LOG_ALL was negotiated and no log recorded.
    dirty_log_misses: u64,
    /// The first problem, for the log line.
    first: Option<String>,
}

impl TreatIssues {
    fn note(&mut self, what: std::fmt::Arguments<'_>) {
        if self.first.is_none() {
            self.first = Some(what.to_string());
        }
    }

    fn merge(&mut self, o: TreatIssues) {
        self.errors += o.errors;
        self.dirty_log_misses += o.dirty_log_misses;
        if self.first.is_none() {
            self.first = o.first;
        }
    }

    /// One line for the chain `what`, sparse over such chains: a guest can
    /// send 65,536 PFNs per inflate chain that all fail the same way.
    fn log(&self, m: &Metrics, what: std::fmt::Arguments<'_>) {
        let Some(first) = &self.first else {
            return;
        };
        let n = bump(&m.chains_with_errors);
        log_sparse(
            Level::Warn,
            n,
            format_args!(
                "{what}: {} range(s) with a failed discard or fill, {} changed without a \
                 dirty log while LOG_ALL is negotiated; first: {first}",
                self.errors, self.dirty_log_misses
            ),
        );
    }
}

impl TreatCtx {
    /// Applies `t` to the valid range `r`; returns the parts that `t`
    /// promised to initialize and that could not be. A range the device
    /// changed is marked in the frontend's dirty log; while the frontend
    /// migrates (LOG_ALL) a range the log did not record counts as not
    /// initialized, since the destination would not get it. Problems are
    /// counted and noted in `issues` (the caller logs them per chain).
    fn treat(
        &self,
        mem: &GuestMem,
        r: GuestRange,
        t: Treatment,
        issues: &mut TreatIssues,
    ) -> Vec<GuestRange> {
        let m = &self.state.metrics;
        let t0 = Instant::now();
        let (mut o, err) = treat_range(self.discarder.as_ref(), mem, r, t);
        if o.discarded + o.zero_filled + o.pattern_filled > 0 {
            let logged = discard::mark_dirty(mem, r);
            if self.migrating && !logged && t != Treatment::Release {
                add(&m.dirty_log_misses, 1);
                issues.dirty_log_misses += 1;
                issues.note(format_args!(
                    "no dirty log for {:#x}+{:#x}: not acknowledged as initialized",
                    r.gpa, r.len
                ));
                o.uninitialized = vec![r];
            }
        }
        m.record_discard_latency(t0.elapsed());
        add(&m.discarded_bytes, o.discarded);
        add(&m.zero_filled_bytes, o.zero_filled);
        add(&m.poison_filled_bytes, o.pattern_filled);
        add(&m.partial_page_skipped_bytes, o.skipped);
        add(&m.uninitialized_bytes, o.uninitialized_bytes());
        add(&m.discard_errors, o.discard_errors);
        add(&m.fill_errors, o.fill_errors);
        if let Some(e) = err {
            issues.errors += 1;
            issues.note(format_args!("range {:#x}+{:#x}: {e}", r.gpa, r.len));
        }
        o.uninitialized
    }
}

/// One popped reporting_vq chain whose ranges are being treated. The task
/// that finishes the last range completes it: the used element is added
/// only then, i.e. after every range was discarded or filled and marked in
/// the dirty log.
struct ReportJob {
    head: u16,
    vring: VringRwLock<GM>,
    /// The memory map current when the chain was popped (kept mapped until
    /// the job is done).
    mem: Arc<GuestMem>,
    ctx: TreatCtx,
    /// Bit 6 negotiated: used length = total length when initialized.
    init: bool,
    /// Lengths of all descriptors of the chain.
    lens: Vec<u32>,
    /// Nothing rejected and every descriptor read: the report can be
    /// initialized if every range is.
    complete_plan: bool,
    popped: Instant,
    remaining: AtomicUsize,
    /// What the finished ranges could not initialize, and their problems.
    outcome: Mutex<(Vec<GuestRange>, TreatIssues)>,
    _in_flight: InFlight,
}

impl ReportJob {
    /// Treats one range; the last one completes the report.
    fn run(&self, r: GuestRange, t: Treatment) {
        let mut issues = TreatIssues::default();
        let u = self.ctx.treat(&self.mem, r, t, &mut issues);
        if !u.is_empty() || issues.first.is_some() {
            let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
            o.0.extend(u);
            o.1.merge(issues);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.complete();
        }
    }

    /// Adds the used element (if the vring is still enabled) and signals.
    fn complete(&self) {
        let m = &self.ctx.state.metrics;
        let clean = {
            let o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
            o.1.log(m, format_args!("report {}", self.head));
            o.0.is_empty()
        };
        let used = if self.init {
            let used = ranges::report_used_len(&self.lens, self.complete_plan && clean);
            if used == 0 {
                add(&m.reports_not_initialized, 1);
                debug!("report not initialized (rejected or failed ranges)");
            }
            used
        } else {
            0
        };
        m.reports_in_flight.fetch_sub(1, Ordering::Relaxed);
        if !self.vring.get_ref().is_enabled() {
            let n = bump(&m.report_acks_dropped);
            log_sparse(
                Level::Warn,
                n,
                format_args!(
                    "report {} treated after its vring was disabled: not acknowledged",
                    self.head
                ),
            );
            return;
        }
        // recorded before the used element is visible, so that whoever
        // sees the ack also sees the counters
        m.record_report_latency(self.popped.elapsed());
        let res = self
            .vring
            .add_used(self.head, used)
            .map_err(BackendError::from)
            .and_then(|()| self.vring.signal_used_queue().map_err(BackendError::Signal));
        if let Err(e) = res {
            let n = m.reject(RejectReason::Malformed);
            log_sparse(Level::Warn, n, format_args!("report {}: {e}", self.head));
        }
    }
}

/// The vhost-user backend of one frontend connection.
#[derive(Clone)]
pub struct BalloonBackend {
    inner: Arc<Inner>,
}

/// Reads the device-readable part of a chain, at most `max` bytes.
fn read_chain(chain: &Chain, mem: &GuestMem, max: usize) -> Result<Vec<u8>, BackendError> {
    let mut out = Vec::new();
    for desc in chain.readable() {
        let len = usize::try_from(desc.len).unwrap_or(usize::MAX);
        if out.len().saturating_add(len) > max {
            return Err(BackendError::BadChain(format!(
                "buffer longer than {max} bytes"
            )));
        }
        let start = out.len();
        out.resize(start + len, 0);
        mem.read_slice(&mut out[start..], GuestAddress(desc.addr))
            .map_err(|e| {
                BackendError::BadChain(format!("descriptor {:#x}+{len}: {e}", desc.addr))
            })?;
    }
    Ok(out)
}

/// Writes `data` into the device-writable descriptors of a chain, in order.
/// The caller checked that they are long enough.
fn write_chain(chain: &Chain, mem: &GuestMem, data: &[u8]) -> Result<(), BackendError> {
    let mut rest = data;
    for desc in chain.writable() {
        if rest.is_empty() {
            break;
        }
        let n = usize::try_from(desc.len)
            .unwrap_or(usize::MAX)
            .min(rest.len());
        mem.write_slice(&rest[..n], GuestAddress(desc.addr))
            .map_err(|e| BackendError::BadChain(format!("descriptor {:#x}+{n}: {e}", desc.addr)))?;
        rest = &rest[n..];
    }
    if rest.is_empty() {
        Ok(())
    } else {
        Err(BackendError::BadChain(format!(
            "{} bytes did not fit in the writable descriptors",
            rest.len()
        )))
    }
}

/// The guest memory regions as validation input.
pub fn region_infos(mem: &GuestMem) -> Vec<RegionInfo> {
    mem.iter()
        .map(|r| RegionInfo {
            gpa: r.start_addr().0,
            len: r.len(),
        })
        .collect()
}

impl BalloonBackend {
    /// Creates the backend for one connection with the default number of
    /// discard workers ([`pool::default_threads`]); if they cannot be
    /// started, reports are treated on the vring thread.
    pub fn new(
        state: Arc<DeviceState>,
        discarder: Arc<dyn Discarder>,
        features: DeviceFeatures,
    ) -> Self {
        let pool = DiscardPool::new(pool::default_threads()).unwrap_or_else(|e| {
            warn!("{e}: reports are treated on the vring thread");
            DiscardPool::empty()
        });
        Self::with_pool(state, discarder, features, pool)
    }

    /// Creates the backend for one connection with `threads` discard
    /// workers (0: reports are treated on the vring thread).
    pub fn with_discard_threads(
        state: Arc<DeviceState>,
        discarder: Arc<dyn Discarder>,
        features: DeviceFeatures,
        threads: usize,
    ) -> Result<Self, BackendError> {
        let pool = DiscardPool::new(threads)?;
        Ok(Self::with_pool(state, discarder, features, pool))
    }

    fn with_pool(
        state: Arc<DeviceState>,
        discarder: Arc<dyn Discarder>,
        features: DeviceFeatures,
        pool: DiscardPool,
    ) -> Self {
        let virtio = features.virtio_features(discarder.releases_memory());
        state.connection_started(virtio);
        Self {
            inner: Arc::new(Inner {
                state,
                discarder,
                features: virtio,
                protocol: features.protocol_features(),
                mem: Mutex::new(None),
                acked: AtomicU64::new(0),
                stats_head: Mutex::new(None),
                negotiations: AtomicU64::new(0),
                mem_tables: AtomicU64::new(0),
                resets: AtomicU64::new(0),
                poison_writes: AtomicU64::new(0),
                pool,
            }),
        }
    }

    /// Number of discard worker threads (0: inline on the vring thread).
    pub fn discard_threads(&self) -> usize {
        self.inner.pool.threads()
    }

    /// Blocks until every report popped so far has been treated and
    /// completed (see `pool.rs`).
    pub fn quiesce(&self) {
        let n = self.inner.pool.in_flight();
        if n > 0 {
            debug!("waiting for {n} report(s) in flight");
        }
        self.inner.pool.quiesce();
    }

    fn treat_ctx(&self) -> TreatCtx {
        TreatCtx {
            state: self.inner.state.clone(),
            discarder: self.inner.discarder.clone(),
            migrating: has(self.acked(), spec::F_LOG_ALL),
        }
    }

    fn acked(&self) -> u64 {
        self.inner.acked.load(Ordering::Relaxed)
    }

    fn memory(&self) -> Result<Mem, BackendError> {
        let g = self.inner.mem.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().map(|m| m.memory()).ok_or(BackendError::NoMemory)
    }

    fn metrics(&self) -> &Metrics {
        &self.inner.state.metrics
    }

    /// Counts an ignored kick; logs the first one and then every time the
    /// count reaches a power of two (a guest must not flood the log).
    fn bad_kick(&self, e: &BackendError) {
        let n = bump(&self.metrics().bad_queue_kicks);
        log_sparse(Level::Warn, n, format_args!("kick ignored: {e}"));
    }

    /// Counts a malformed chain or payload and logs it sparsely.
    fn malformed(&self, msg: std::fmt::Arguments<'_>) {
        let n = self.metrics().reject(RejectReason::Malformed);
        log_sparse(Level::Warn, n, msg);
    }

    /// Counts the rejected ranges of one chain (of `total` ranges) by
    /// reason and logs one summary line for the chain, sparsely: a guest
    /// can send 65,536 bad PFNs per inflate chain, chain after chain.
    fn count_rejects(&self, rejects: &[(GuestRange, RejectReason)], total: usize, what: &str) {
        let Some(&(first, first_why)) = rejects.first() else {
            return;
        };
        let m = self.metrics();
        let mut by_reason = [0usize; RejectReason::ALL.len()];
        for (_, why) in rejects {
            m.reject(*why);
            if let Some(i) = RejectReason::ALL.iter().position(|r| r == why) {
                by_reason[i] += 1;
            }
        }
        let reasons: Vec<String> = RejectReason::ALL
            .iter()
            .zip(by_reason)
            .filter(|(_, k)| *k > 0)
            .map(|(r, k)| format!("{r:?} {k}"))
            .collect();
        let n = bump(&m.chains_with_rejects);
        log_sparse(
            Level::Warn,
            n,
            format_args!(
                "{what}: {} of {total} range(s) rejected ({}; first {:#x}+{:#x}: {first_why:?})",
                rejects.len(),
                reasons.join(", "),
                first.gpa,
                first.len
            ),
        );
    }

    /// Applies `t` to every valid range of `plan` on this thread; returns
    /// the parts that `t` promised to initialize and that could not be.
    fn treat_ranges(&self, mem: &GuestMem, plan: &Plan, t: Treatment) -> Vec<GuestRange> {
        let ctx = self.treat_ctx();
        let mut issues = TreatIssues::default();
        let u = plan
            .ranges
            .iter()
            .flat_map(|(_, r)| ctx.treat(mem, *r, t, &mut issues))
            .collect();
        issues.log(self.metrics(), format_args!("inflate"));
        u
    }

    /// Pops every available chain, reads it ([`Chain::read`]), lets `f`
    /// handle it, returns the ones `f` completes (`Some(used_len)`), and
    /// signals the guest once. A malformed chain is counted and returned
    /// with used length 0 (a head past the end of the ring cannot be
    /// returned at all); either way the rest of the batch is served.
    fn drain_queue<F>(&self, vring: &VringRwLock<GM>, mut f: F) -> Result<(), BackendError>
    where
        F: FnMut(&Mem, &Chain) -> Option<u32>,
    {
        let mem = self.memory()?;
        let (table, size) = {
            let st = vring.get_ref();
            let q = st.get_queue();
            (q.desc_table(), q.size())
        };
        let heads: Vec<u16> = vring
            .get_mut()
            .get_queue_mut()
            .iter(mem.clone())?
            .map(|c| c.head_index())
            .collect();
        let mut used = false;
        for head in heads {
            let len = match Chain::read(&mem, table, size, head) {
                Ok(chain) => f(&mem, &chain),
                Err(e @ ChainError::HeadOutOfRange { .. }) => {
                    self.malformed(format_args!("chain not returned: {e}"));
                    None
                }
                Err(e) => {
                    self.malformed(format_args!("chain returned unused: {e}"));
                    Some(0)
                }
            };
            if let Some(len) = len {
                match vring.add_used(head, len) {
                    Ok(()) => used = true,
                    Err(e) => self.malformed(format_args!("chain {head}: {e}")),
                }
            }
        }
        if used {
            vring.signal_used_queue().map_err(BackendError::Signal)?;
        }
        Ok(())
    }

    /// inflateq: PFNs of pages the guest gives up. They are discarded on the
    /// host (coalesced into ranges first). Under bit 7 the chain ends with a
    /// device-writable bitmap that tells the driver which pages were
    /// initialized (zeroed); with a non-zero `poison_val` the pages are still
    /// released but none is reported initialized (filling them would keep
    /// the memory the balloon is meant to give back).
    pub fn process_inflate(&self, vring: &VringRwLock<GM>) -> Result<(), BackendError> {
        let bitmap = has(self.acked(), spec::F_DEVICE_INIT_ON_INFLATE);
        let zeroed = bitmap && self.inner.state.init_pattern() == 0;
        let t = if zeroed {
            Treatment::ReleaseZeroed
        } else {
            Treatment::Release
        };
        self.drain_queue(vring, |mem, chain| {
            let done = self.handle_pfn_chain(mem, chain, true, t);
            if !bitmap {
                return Some(0);
            }
            Some(self.write_inflate_bitmap(mem, chain, done, zeroed))
        })
    }

    /// Writes the bit 7 bitmap of an inflate chain; returns the used length.
    fn write_inflate_bitmap(
        &self,
        mem: &GuestMem,
        chain: &Chain,
        done: Option<PfnChain>,
        zeroed: bool,
    ) -> u32 {
        let m = self.metrics();
        let Some(done) = done else {
            // unreadable chain: no PFNs known, nothing to report
            add(&m.inflate_bitmap_errors, 1);
            return 0;
        };
        let map = if zeroed {
            ranges::inflate_bitmap(&done.pfns, &region_infos(mem), &done.uninitialized)
        } else {
            vec![0u8; spec::inflate_bitmap_len(done.pfns.len())]
        };
        let set: u32 = map.iter().map(|b| b.count_ones()).sum();
        let len = u32::try_from(map.len()).unwrap_or(u32::MAX);
        let res = if chain.writable_len() < u64::from(len) {
            Err(BackendError::BadChain(format!(
                "no room for the {len}-byte bitmap of {} PFNs",
                done.pfns.len()
            )))
        } else {
            write_chain(chain, mem, &map)
        };
        if let Err(e) = res {
            // e.g. a driver that negotiated bit 7 under its older reading
            // and sends no bitmap: one line per chain would flood the log
            let n = bump(&m.inflate_bitmap_errors);
            add(&m.pfns_not_initialized, done.pfns.len() as u64);
            log_sparse(Level::Warn, n, format_args!("inflate: {e}"));
            return 0;
        }
        add(
            &m.pfns_not_initialized,
            done.pfns.len() as u64 - u64::from(set),
        );
        len
    }

    /// deflateq: PFNs the guest takes back. Nothing to do on the host: the
    /// pages were discarded on inflate and fault back in on first touch.
    pub fn process_deflate(&self, vring: &VringRwLock<GM>) -> Result<(), BackendError> {
        self.drain_queue(vring, |mem, chain| {
            self.handle_pfn_chain(mem, chain, false, Treatment::Release);
            Some(0)
        })
    }

    fn handle_pfn_chain(
        &self,
        mem: &GuestMem,
        chain: &Chain,
        inflate: bool,
        t: Treatment,
    ) -> Option<PfnChain> {
        let m = self.metrics();
        let what = if inflate { "inflate" } else { "deflate" };
        let pfns =
            match read_chain(chain, mem, MAX_PFN_BYTES).and_then(|b| Ok(ranges::parse_pfns(&b)?)) {
                Ok(p) => p,
                Err(e) => {
                    self.malformed(format_args!("{what}: {e}"));
                    return None;
                }
            };
        let regions = region_infos(mem);
        let plan = ranges::plan(&ranges::pfns_to_ranges(&pfns), &regions, PAGE_SIZE);
        let n = pfns.len() as u64;
        if inflate {
            add(&m.inflate_requests, 1);
            add(&m.inflated_pages, n);
        } else {
            add(&m.deflate_requests, 1);
            add(&m.deflated_pages, n);
        }
        debug!("{what}: {n} pages in {} ranges", plan.ranges.len());
        self.count_rejects(&plan.rejects, pfns.len(), what);
        let uninitialized = if inflate {
            self.treat_ranges(mem, &plan, t)
        } else {
            Vec::new()
        };
        Some(PfnChain {
            pfns,
            uninitialized,
        })
    }

    /// statsq: keep the latest statistics and hold the buffer; it is given
    /// back (used) only when the operator asks for fresh stats.
    pub fn process_stats(&self, vring: &VringRwLock<GM>) -> Result<(), BackendError> {
        let mut stale = Vec::new();
        self.drain_queue(vring, |mem, chain| {
            let head = chain.head;
            match read_chain(chain, mem, MAX_STATS_BYTES).and_then(|b| Ok(ranges::parse_stats(&b)?))
            {
                Ok(stats) => {
                    add(&self.metrics().stats_updates, 1);
                    debug!("stats: {} entries", stats.len());
                    self.inner.state.store_stats(stats);
                }
                Err(e) => self.malformed(format_args!("stats: {e}")),
            }
            let mut held = self
                .inner
                .stats_head
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some(old) = held.replace(head) {
                // The driver queued a second buffer; give the older one back.
                stale.push(old);
            }
            None
        })?;
        for old in stale {
            match vring.add_used(old, 0) {
                Ok(()) => vring.signal_used_queue().map_err(BackendError::Signal)?,
                Err(e) => self.malformed(format_args!("stats buffer {old}: {e}")),
            }
        }
        Ok(())
    }

    /// Forgets the held stats buffer (the ring was stopped or the driver
    /// renegotiated: the descriptor belongs to a ring that no longer exists).
    fn drop_held_stats(&self) {
        if let Some(h) = self
            .inner
            .stats_head
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            debug!("dropping held stats buffer {h}");
        }
    }

    /// Operator asked for fresh stats: return the held buffer.
    pub fn process_stats_request(&self, vring: &VringRwLock<GM>) -> Result<(), BackendError> {
        {
            let st = vring.get_ref();
            if !(st.get_queue().ready() && st.is_enabled()) {
                // Never write a ring the driver stopped or disabled.
                drop(st);
                self.drop_held_stats();
                return Ok(());
            }
        }
        let head = self
            .inner
            .stats_head
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(h) = head {
            vring.add_used(h, 0)?;
            vring.signal_used_queue().map_err(BackendError::Signal)?;
            add(&self.metrics().stats_requests, 1);
        } else {
            debug!("stats requested but the guest holds no buffer with us");
        }
        Ok(())
    }

    /// reporting_vq: every descriptor is a free guest range; discard it and
    /// return the chain. Under bit 6 the device initializes every page
    /// (discard, and zero-fill what could not be discarded; or fill with
    /// `poison_val` under PAGE_POISON) and returns used length = total length
    /// only when all of it was initialized, 0 otherwise.
    ///
    /// The ranges are treated by the discard workers, one task per range;
    /// this returns as soon as they are queued. The used element of a chain
    /// is added (and the guest signalled) by the task that finishes its last
    /// range, so chains can complete out of order, never before all of their
    /// ranges are done.
    pub fn process_reporting(&self, vring: &VringRwLock<GM>) -> Result<(), BackendError> {
        let init = has(self.acked(), spec::F_DEVICE_INIT_REPORTED);
        let pattern = self.inner.state.init_pattern();
        // None: keep the pages as they are
        let t = match (init, pattern) {
            (true, 0) => Some(Treatment::ReleaseZeroed),
            (true, p) => Some(Treatment::Fill(p)),
            (false, 0) => Some(Treatment::Release),
            (false, _) => None,
        };
        self.drain_queue(vring, |mem, chain| {
            let popped = Instant::now();
            let m = self.metrics();
            let lens: Vec<u32> = chain.descs.iter().map(|d| d.len).collect();
            // Ranges come from the device-writable descriptors only (as
            // QEMU takes them from in_sg); a read-only one is malformed.
            let (writable, read_only): (Vec<_>, Vec<_>) = chain
                .descs
                .iter()
                .take(MAX_REPORT_DESCS)
                .map(|d| (GuestRange::new(d.addr, u64::from(d.len)), d.writable))
                .partition(|(_, w)| *w);
            let descs: Vec<GuestRange> = writable.into_iter().map(|(r, _)| r).collect();
            add(&m.reports, 1);
            add(&m.reported_ranges, lens.len() as u64);
            let plan = ranges::plan(&descs, &region_infos(mem), PAGE_SIZE);
            let mut rejects = plan.rejects.clone();
            rejects.extend(
                read_only
                    .into_iter()
                    .map(|(r, _)| (r, RejectReason::Malformed)),
            );
            self.count_rejects(&rejects, lens.len(), "report");
            add(&m.reported_bytes, plan.valid_bytes());
            let todo: Vec<GuestRange> = match t {
                Some(_) => plan.ranges.iter().map(|(_, r)| *r).collect(),
                None => {
                    // virtio 1.2 5.5.6.7: with PAGE_POISON negotiated the
                    // device must not change reported pages to anything but
                    // poison_val; discarding would make them zero.
                    add(&m.poison_skipped_bytes, plan.valid_bytes());
                    Vec::new()
                }
            };
            add(&m.reports_in_flight, 1);
            let job = Arc::new(ReportJob {
                head: chain.head,
                vring: vring.clone(),
                mem: mem.clone().into_inner(),
                ctx: self.treat_ctx(),
                init,
                complete_plan: rejects.is_empty() && descs.len() == lens.len(),
                lens,
                popped,
                remaining: AtomicUsize::new(todo.len()),
                outcome: Mutex::new((Vec::new(), TreatIssues::default())),
                _in_flight: self.inner.pool.begin(),
            });
            match t {
                Some(t) if !todo.is_empty() => {
                    for r in todo {
                        let j = job.clone();
                        self.inner.pool.spawn(Box::new(move || j.run(r, t)));
                    }
                }
                _ => job.complete(),
            }
            None
        })
    }
}

/// What the PFN handler learnt about a chain.
struct PfnChain {
    /// The PFNs, in chain order.
    pfns: Vec<u32>,
    /// Parts that the treatment promised to initialize and could not.
    uninitialized: Vec<GuestRange>,
}

impl VhostUserBackend for BalloonBackend {
    type Bitmap = LogBitmap;
    type Vring = VringRwLock<GM>;

    fn num_queues(&self) -> usize {
        MAX_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        self.inner.features
    }

    fn acked_features(&self, features: u64) {
        // (Re)negotiation starts a new driver instance: whatever buffer we
        // held belongs to the old rings. A frontend that only turns dirty
        // logging on or off (migration) keeps the driver and its rings.
        let log = spec::bit(spec::F_LOG_ALL);
        if (self.acked() | log) != (features | log) {
            self.drop_held_stats();
        }
        // reports popped under the old features complete under them
        self.quiesce();
        self.inner.acked.store(features, Ordering::Relaxed);
        let cleared = self.inner.state.features_negotiated(features);
        let n = bump(&self.inner.negotiations);
        log_sparse(
            Level::Info,
            n,
            format_args!(
                "negotiated virtio features {features:#x}{}",
                if cleared {
                    " (PAGE_POISON not negotiated: poison_val cleared)"
                } else {
                    ""
                }
            ),
        );
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.inner.protocol
    }

    fn reset_device(&self) {
        // The library disabled every vring before this call: what is in
        // flight finishes its discards and is not acknowledged.
        self.quiesce();
        *self
            .inner
            .stats_head
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        self.inner.acked.store(0, Ordering::Relaxed);
        self.inner.state.device_reset();
        let n = bump(&self.inner.resets);
        log_sparse(
            Level::Info,
            n,
            format_args!("device reset: actual and poison_val cleared"),
        );
    }

    fn set_event_idx(&self, _enabled: bool) {}

    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        debug!("ring {queue_index} stopped");
        // Complete the reports popped so far before the frontend reads the
        // ring state back (GET_VRING_BASE).
        self.quiesce();
        let stats = spec::queue_index(self.acked(), QueueRole::Stats);
        if usize::try_from(queue_index).ok() == stats {
            self.drop_held_stats();
        }
        Ok(())
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.inner.state.config().read(offset, size)
    }

    fn set_config(&self, offset: u32, buf: &[u8]) -> io::Result<()> {
        let state = &self.inner.state;
        let mut g = state.lock();
        match g.config.apply_write(offset, buf) {
            Ok(w) => {
                let c = w.config;
                if w.ignored > 0 {
                    debug!(
                        "config write at {offset}+{}: {} bytes of device-owned fields ignored",
                        buf.len(),
                        w.ignored
                    );
                }
                if c.poison_val != g.config.poison_val {
                    let f = g.acked_features;
                    let effect = if c.poison_val == 0 || !has(f, spec::F_PAGE_POISON) {
                        ""
                    } else if has(f, spec::F_DEVICE_INIT_REPORTED) {
                        " (PAGE_POISON: reported pages are filled with it, inflated pages \
                         are released but not reported initialized)"
                    } else {
                        " (PAGE_POISON: reported pages are kept, inflated pages are \
                         released but not reported initialized)"
                    };
                    let n = bump(&self.inner.poison_writes);
                    log_sparse(
                        Level::Info,
                        n,
                        format_args!("guest set poison_val {:#x}{effect}", c.poison_val),
                    );
                }
                if c.actual != g.config.actual {
                    debug!("guest reports {} pages in balloon", c.actual);
                }
                g.config = c;
                Ok(())
            }
            Err(e) => {
                // Ignore the write (as a device ignores writes to read-only
                // config fields). Returning an error here would make the
                // library drop the whole connection.
                let n = bump(&state.metrics.config_write_rejects);
                log_sparse(
                    Level::Warn,
                    n,
                    format_args!("ignored: {}", BackendError::Config(e)),
                );
                Ok(())
            }
        }
    }

    fn update_memory(&self, mem: GM) -> io::Result<()> {
        // In-flight tasks hold the old map; answer only when they are done.
        self.quiesce();
        let regions: Vec<String> = region_infos(&mem.memory())
            .iter()
            .map(|r| format!("{:#x}+{:#x}", r.gpa, r.len))
            .collect();
        let n = bump(&self.inner.mem_tables);
        log_sparse(
            Level::Info,
            n,
            format_args!("guest memory: {}", regions.join(", ")),
        );
        *self.inner.mem.lock().unwrap_or_else(|p| p.into_inner()) = Some(mem);
        Ok(())
    }

    fn set_backend_req_fd(&self, _backend: Backend) {
        // The real channel was captured by the shim (see shim.rs); the
        // library's end is only a local socketpair.
        debug!("library backend request channel set");
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock<GM>],
        _thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(BackendError::UnexpectedEvent(device_event, evset).into());
        }
        // The event in progress counts as in flight too: a quiesce that
        // starts while this thread has popped chains but not yet queued
        // their tasks waits for them (see `pool.rs`).
        let _busy = self.inner.pool.begin();
        let acked = self.acked();
        if device_event == STATS_REQUEST_EVENT {
            // Drain the counter; EAGAIN just means a spurious wakeup.
            let _ = self.inner.state.stats_request.read();
            if let Some(i) = spec::queue_index(acked, QueueRole::Stats) {
                if let Some(v) = vrings.get(i) {
                    self.process_stats_request(v)?;
                }
            }
            return Ok(());
        }
        let idx = usize::from(device_event);
        let found = match spec::queue_role(acked, idx) {
            Ok(role) => vrings
                .get(idx)
                .map(|v| (v, role))
                .ok_or(BackendError::UnexpectedEvent(device_event, evset)),
            Err(e) => Err(BackendError::from(e)),
        };
        let (vring, role) = match found {
            Ok(v) => v,
            Err(e) => {
                // A kick on a ring that does not exist for the negotiated
                // features. Returning an error would end this worker thread
                // and no queue would ever be served again: ignore it.
                self.bad_kick(&e);
                return Ok(());
            }
        };
        let res = match role {
            QueueRole::Inflate => self.process_inflate(vring),
            QueueRole::Deflate => self.process_deflate(vring),
            QueueRole::Stats => self.process_stats(vring),
            QueueRole::Reporting => self.process_reporting(vring),
        };
        // A broken queue must not kill the device: count and log it.
        if let Err(e) = res {
            self.malformed(format_args!("queue {idx}: {e}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_all_is_offered_only_with_log_shmfd() {
        let on = DeviceFeatures {
            init_reported: true,
            init_on_inflate: true,
            ..DeviceFeatures::default()
        };
        assert!(has(on.virtio_features(true), spec::F_LOG_ALL));
        assert!(on
            .protocol_features()
            .contains(VhostUserProtocolFeatures::LOG_SHMFD));
        let off = DeviceFeatures {
            dirty_log: false,
            ..on
        };
        assert!(!has(off.virtio_features(true), spec::F_LOG_ALL));
        assert!(!off
            .protocol_features()
            .contains(VhostUserProtocolFeatures::LOG_SHMFD));
        // bits 6/7 need a discarder that releases memory
        let f = on.virtio_features(false);
        assert!(!has(f, spec::F_DEVICE_INIT_REPORTED) && !has(f, spec::F_DEVICE_INIT_ON_INFLATE));
        let f = on.virtio_features(true);
        assert!(has(f, spec::F_DEVICE_INIT_REPORTED) && has(f, spec::F_DEVICE_INIT_ON_INFLATE));
        // experimental: neither is offered unless asked for
        let f = DeviceFeatures::default().virtio_features(true);
        assert!(!has(f, spec::F_DEVICE_INIT_REPORTED) && !has(f, spec::F_DEVICE_INIT_ON_INFLATE));
    }
}
