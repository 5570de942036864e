//! Counters exported on the control socket (`get_counters`), and the rule
//! for logging what the guest or the frontend can repeat at will: the
//! counters keep the detail, the log gets a line when a count reaches a
//! power of two ([`log_sparse`]).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use log::Level;
use serde::Serialize;

use crate::ranges::RejectReason;

/// Lock-free counters, shared by the backend threads and the control socket.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Inflate buffers processed.
    pub inflate_requests: AtomicU64,
    /// PFNs received on inflateq.
    pub inflated_pages: AtomicU64,
    /// Deflate buffers processed.
    pub deflate_requests: AtomicU64,
    /// PFNs received on deflateq.
    pub deflated_pages: AtomicU64,
    /// Report buffers (descriptor chains) processed on reporting_vq.
    pub reports: AtomicU64,
    /// Ranges (descriptors) received on reporting_vq.
    pub reported_ranges: AtomicU64,
    /// Bytes in valid reported ranges.
    pub reported_bytes: AtomicU64,
    /// Bytes given back to the host (hole punched / madvised).
    pub discarded_bytes: AtomicU64,
    /// Bytes that were not discarded (partial huge pages, failed discards)
    /// and were written with zeroes because the device promised to
    /// initialize them (bit 6 or 7).
    pub zero_filled_bytes: AtomicU64,
    /// Reported bytes written with `poison_val` (bit 6 with PAGE_POISON and
    /// a non-zero `poison_val`).
    pub poison_filled_bytes: AtomicU64,
    /// Bytes left as they were with no promise to the guest: partial huge
    /// pages, and ranges whose discard failed.
    pub partial_page_skipped_bytes: AtomicU64,
    /// Reported bytes kept because PAGE_POISON with poison_val != 0 was
    /// negotiated without bit 6.
    pub poison_skipped_bytes: AtomicU64,
    /// Discard system calls that failed.
    pub discard_errors: AtomicU64,
    /// Fill attempts (zeroes or `poison_val`) that failed.
    pub fill_errors: AtomicU64,
    /// Valid bytes the device promised to initialize and could not (they
    /// were acknowledged as not initialized).
    pub uninitialized_bytes: AtomicU64,
    /// Reports returned with used length 0 under bit 6 (not initialized).
    pub reports_not_initialized: AtomicU64,
    /// PFNs whose bit was left clear in the inflate bitmap under bit 7.
    pub pfns_not_initialized: AtomicU64,
    /// Inflate chains under bit 7 without room for the bitmap (returned
    /// with used length 0).
    pub inflate_bitmap_errors: AtomicU64,
    /// Number of discard operations timed.
    pub discard_ops: AtomicU64,
    /// Sum of discard latency, nanoseconds.
    pub discard_ns_sum: AtomicU64,
    /// Maximum discard latency, nanoseconds.
    pub discard_ns_max: AtomicU64,
    /// Reports acknowledged (used element added) on reporting_vq.
    pub report_acks: AtomicU64,
    /// Sum of report -> ack latency (chain popped -> used element added,
    /// after every range of the chain was treated), nanoseconds.
    pub report_ack_ns_sum: AtomicU64,
    /// Maximum report -> ack latency, nanoseconds.
    pub report_ack_ns_max: AtomicU64,
    /// Reports whose ranges were treated but whose used element was not
    /// added because the vring had been disabled meanwhile.
    pub report_acks_dropped: AtomicU64,
    /// Reports popped and not yet acknowledged (a gauge).
    pub reports_in_flight: AtomicU64,
    /// Stats buffers received.
    pub stats_updates: AtomicU64,
    /// Stats requests sent to the guest.
    pub stats_requests: AtomicU64,
    /// Config-space writes rejected.
    pub config_write_rejects: AtomicU64,
    /// Ranges changed while LOG_ALL was negotiated that the dirty log did
    /// not record (no log shared): acknowledged as not initialized.
    pub dirty_log_misses: AtomicU64,
    /// Kicks on a virtqueue that does not exist for the negotiated
    /// features (ignored).
    pub bad_queue_kicks: AtomicU64,
    /// Config change notifications sent to the frontend.
    pub config_notifications: AtomicU64,
    /// Config change notifications not sent because the frontend does not
    /// read its backend request channel (it is full).
    pub config_notifications_dropped: AtomicU64,
    /// Descriptor chains (inflate, deflate, report) with at least one
    /// rejected range.
    pub chains_with_rejects: AtomicU64,
    /// Chains (inflate, report) with at least one range whose discard or
    /// fill failed, or that the dirty log missed.
    pub chains_with_errors: AtomicU64,
    /// Frontend connections accepted.
    pub connections: AtomicU64,
    /// Rejected ranges, indexed like `RejectReason::ALL`.
    pub rejects: [AtomicU64; 6],
}

/// Helper for "add n".
pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Adds one and returns the new count (for [`log_sparse`]).
pub fn bump(c: &AtomicU64) -> u64 {
    c.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
}

/// Logs the `n`-th occurrence of an event that a guest or a frontend can
/// repeat at will: at `level` when `n` is a power of two (1, 2, 4, ...),
/// at `debug` otherwise. A flood of `n` events costs about log2(n) lines at
/// the default log level; the counter that gave `n` keeps the exact number.
pub fn log_sparse(level: Level, n: u64, msg: fmt::Arguments<'_>) {
    let level = if n.is_power_of_two() {
        level
    } else {
        Level::Debug
    };
    log::log!(level, "{msg} ({n} so far)");
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

impl Metrics {
    /// Counts one rejected range; returns the count for that reason.
    pub fn reject(&self, reason: RejectReason) -> u64 {
        RejectReason::ALL
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| bump(&self.rejects[i]))
    }

    /// Records the latency of one discard operation.
    pub fn record_discard_latency(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        add(&self.discard_ops, 1);
        add(&self.discard_ns_sum, ns);
        self.discard_ns_max.fetch_max(ns, Ordering::Relaxed);
    }

    /// Records the report -> ack latency of one report.
    pub fn record_report_latency(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        add(&self.report_acks, 1);
        add(&self.report_ack_ns_sum, ns);
        self.report_ack_ns_max.fetch_max(ns, Ordering::Relaxed);
    }

    /// Point-in-time copy for serialisation.
    pub fn snapshot(&self) -> MetricsSnapshot {
        MetricsSnapshot {
            inflate_requests: get(&self.inflate_requests),
            inflated_pages: get(&self.inflated_pages),
            deflate_requests: get(&self.deflate_requests),
            deflated_pages: get(&self.deflated_pages),
            reports: get(&self.reports),
            reported_ranges: get(&self.reported_ranges),
            reported_bytes: get(&self.reported_bytes),
            discarded_bytes: get(&self.discarded_bytes),
            zero_filled_bytes: get(&self.zero_filled_bytes),
            poison_filled_bytes: get(&self.poison_filled_bytes),
            partial_page_skipped_bytes: get(&self.partial_page_skipped_bytes),
            poison_skipped_bytes: get(&self.poison_skipped_bytes),
            discard_errors: get(&self.discard_errors),
            fill_errors: get(&self.fill_errors),
            uninitialized_bytes: get(&self.uninitialized_bytes),
            reports_not_initialized: get(&self.reports_not_initialized),
            pfns_not_initialized: get(&self.pfns_not_initialized),
            inflate_bitmap_errors: get(&self.inflate_bitmap_errors),
            discard_ops: get(&self.discard_ops),
            discard_ns_sum: get(&self.discard_ns_sum),
            discard_ns_max: get(&self.discard_ns_max),
            report_acks: get(&self.report_acks),
            report_ack_ns_sum: get(&self.report_ack_ns_sum),
            report_ack_ns_max: get(&self.report_ack_ns_max),
            report_acks_dropped: get(&self.report_acks_dropped),
            reports_in_flight: get(&self.reports_in_flight),
            stats_updates: get(&self.stats_updates),
            stats_requests: get(&self.stats_requests),
            config_write_rejects: get(&self.config_write_rejects),
            bad_queue_kicks: get(&self.bad_queue_kicks),
            dirty_log_misses: get(&self.dirty_log_misses),
            config_notifications: get(&self.config_notifications),
            config_notifications_dropped: get(&self.config_notifications_dropped),
            chains_with_rejects: get(&self.chains_with_rejects),
            chains_with_errors: get(&self.chains_with_errors),
            connections: get(&self.connections),
            rejects: Rejects {
                empty: get(&self.rejects[0]),
                overflow: get(&self.rejects[1]),
                unaligned: get(&self.rejects[2]),
                outside_memory: get(&self.rejects[3]),
                crosses_region: get(&self.rejects[4]),
                malformed: get(&self.rejects[5]),
            },
        }
    }
}

/// Rejected ranges by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Rejects {
    /// zero length
    pub empty: u64,
    /// address overflow
    pub overflow: u64,
    /// not 4 KiB aligned
    pub unaligned: u64,
    /// not inside guest memory
    pub outside_memory: u64,
    /// spans two regions
    pub crosses_region: u64,
    /// malformed descriptor chain / payload
    pub malformed: u64,
}

/// Serialisable copy of [`Metrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[allow(missing_docs)]
pub struct MetricsSnapshot {
    pub inflate_requests: u64,
    pub inflated_pages: u64,
    pub deflate_requests: u64,
    pub deflated_pages: u64,
    pub reports: u64,
    pub reported_ranges: u64,
    pub reported_bytes: u64,
    pub discarded_bytes: u64,
    pub zero_filled_bytes: u64,
    pub poison_filled_bytes: u64,
    pub partial_page_skipped_bytes: u64,
    pub poison_skipped_bytes: u64,
    pub discard_errors: u64,
    pub fill_errors: u64,
    pub uninitialized_bytes: u64,
    pub reports_not_initialized: u64,
    pub pfns_not_initialized: u64,
    pub inflate_bitmap_errors: u64,
    pub discard_ops: u64,
    pub discard_ns_sum: u64,
    pub discard_ns_max: u64,
    pub report_acks: u64,
    pub report_ack_ns_sum: u64,
    pub report_ack_ns_max: u64,
    pub report_acks_dropped: u64,
    pub reports_in_flight: u64,
    pub stats_updates: u64,
    pub stats_requests: u64,
    pub config_write_rejects: u64,
    pub bad_queue_kicks: u64,
    pub dirty_log_misses: u64,
    pub config_notifications: u64,
    pub config_notifications_dropped: u64,
    pub chains_with_rejects: u64,
    pub chains_with_errors: u64,
    pub connections: u64,
    pub rejects: Rejects,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters() {
        let m = Metrics::default();
        m.reject(RejectReason::Unaligned);
        assert_eq!(m.reject(RejectReason::Malformed), 1);
        assert_eq!(m.reject(RejectReason::Malformed), 2);
        m.record_discard_latency(Duration::from_nanos(5));
        m.record_discard_latency(Duration::from_nanos(3));
        let s = m.snapshot();
        assert_eq!(s.rejects.unaligned, 1);
        assert_eq!(s.rejects.malformed, 2);
        assert_eq!(s.discard_ops, 2);
        assert_eq!(s.discard_ns_sum, 8);
        assert_eq!(s.discard_ns_max, 5);
        m.record_report_latency(Duration::from_nanos(7));
        let s = m.snapshot();
        assert_eq!(
            (s.report_acks, s.report_ack_ns_sum, s.report_ack_ns_max),
            (1, 7, 7)
        );
    }
}
