//! Constants from the virtio 1.2 specification (section 5.5, "Memory Balloon
//! Device") and from Linux `include/uapi/linux/virtio_balloon.h`, plus the two
//! feature bits the freepage seed author proposed to the virtio TC (see
//! README.md, "Proposed spec extension"). Those two are **proposed, not
//! allocated**: their numbers and semantics live here and nowhere else.

use thiserror::Error;

/// Virtio device id of the memory balloon.
pub const VIRTIO_ID_BALLOON: u32 = 5;

/// Size of the page unit used by inflate/deflate PFNs (`VIRTIO_BALLOON_PFN_SHIFT`).
pub const PFN_SHIFT: u32 = 12;
/// Device page size: every discarded range is aligned to this.
pub const PAGE_SIZE: u64 = 1 << PFN_SHIFT;

/// Host must be told before pages from the balloon are used.
pub const F_MUST_TELL_HOST: u32 = 0;
/// A virtqueue for reporting guest memory statistics is present.
pub const F_STATS_VQ: u32 = 1;
/// Deflate the balloon on guest out of memory condition.
pub const F_DEFLATE_ON_OOM: u32 = 2;
/// Free page hinting (not implemented by this device, never offered).
pub const F_FREE_PAGE_HINT: u32 = 3;
/// The guest tells the device its page poison / init value in `poison_val`.
pub const F_PAGE_POISON: u32 = 4;
/// A virtqueue for free page reporting is present.
pub const F_REPORTING: u32 = 5;
/// `VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED`: **proposed to the virtio TC, not
/// allocated** (virtio-spec issue #244). The device initializes the pages it
/// uses from reporting_vq (zeroes, or `poison_val` when `PAGE_POISON` is
/// negotiated) and tells the driver per element: used length = total length
/// of the element's buffers when it initialized every page of the element,
/// used length 0 when it did not (the driver then treats them as ordinary
/// free pages).
pub const F_DEVICE_INIT_REPORTED: u32 = 6;
/// `VIRTIO_BALLOON_F_DEVICE_INIT_ON_INFLATE`: **proposed to the virtio TC, not
/// allocated** (virtio-spec issue #242; bit 7 in the author's branch). Each
/// inflateq chain is the driver-readable PFN array (le32 PFNs) followed by one
/// device-writable bitmap of `ceil(n / 8)` bytes for the chain's `n` PFNs; the
/// device sets bit N (LSB first within byte N / 8) when it initialized PFN N
/// and returns used length = bitmap length. Without the feature there is no
/// bitmap and the used length is 0.
pub const F_DEVICE_INIT_ON_INFLATE: u32 = 7;
/// `VHOST_F_LOG_ALL` (vhost, not virtio): the frontend migrates and wants
/// every write of the device to guest memory in its dirty log.
pub const F_LOG_ALL: u32 = 26;
/// `VIRTIO_F_VERSION_1`.
pub const F_VERSION_1: u32 = 32;

/// Returns the feature mask for bit `n`.
pub const fn bit(n: u32) -> u64 {
    1u64 << n
}

/// Returns true when `features` has bit `n` set.
pub const fn has(features: u64, n: u32) -> bool {
    features & bit(n) != 0
}

/// Names of the feature bits set in `features` (for the control socket).
pub fn feature_names(features: u64) -> Vec<&'static str> {
    const NAMES: [(u32, &str); 11] = [
        (F_MUST_TELL_HOST, "MUST_TELL_HOST"),
        (F_STATS_VQ, "STATS_VQ"),
        (F_DEFLATE_ON_OOM, "DEFLATE_ON_OOM"),
        (F_FREE_PAGE_HINT, "FREE_PAGE_HINT"),
        (F_PAGE_POISON, "PAGE_POISON"),
        (F_REPORTING, "REPORTING"),
        (F_DEVICE_INIT_REPORTED, "DEVICE_INIT_REPORTED"),
        (F_DEVICE_INIT_ON_INFLATE, "DEVICE_INIT_ON_INFLATE"),
        (F_LOG_ALL, "LOG_ALL"),
        (30, "VHOST_USER_F_PROTOCOL_FEATURES"),
        (F_VERSION_1, "VERSION_1"),
    ];
    NAMES
        .iter()
        .filter(|(b, _)| has(features, *b))
        .map(|(_, n)| *n)
        .collect()
}

/// Length of the inflate bitmap for a chain of `pfns` PFNs under
/// [`F_DEVICE_INIT_ON_INFLATE`]: one bit per PFN, rounded up to whole bytes.
pub const fn inflate_bitmap_len(pfns: usize) -> usize {
    pfns.div_ceil(8)
}

/// Size in bytes of `struct virtio_balloon_config`.
pub const CONFIG_SIZE: usize = 16;
/// Offset of `num_pages` (device writes, driver reads).
pub const CFG_NUM_PAGES: usize = 0;
/// Offset of `actual` (driver writes).
pub const CFG_ACTUAL: usize = 4;
/// Offset of `free_page_hint_cmd_id` (device writes, driver reads).
pub const CFG_FREE_PAGE_HINT_CMD_ID: usize = 8;
/// Offset of `poison_val` (driver writes).
pub const CFG_POISON_VAL: usize = 12;

/// Size of one `struct virtio_balloon_stat` (packed `le16 tag; le64 val`).
pub const STAT_ENTRY_SIZE: usize = 10;

/// Names of the statistics tags defined in virtio 1.2 / Linux 6.12.
pub const STAT_NAMES: [&str; 16] = [
    "swap_in",
    "swap_out",
    "major_faults",
    "minor_faults",
    "free_memory",
    "total_memory",
    "available_memory",
    "disk_caches",
    "hugetlb_allocations",
    "hugetlb_failures",
    "oom_kills",
    "alloc_stalls",
    "async_scans",
    "direct_scans",
    "async_reclaims",
    "direct_reclaims",
];

/// Human readable name of a stats tag (`tag_<n>` for unknown tags).
pub fn stat_name(tag: u16) -> String {
    STAT_NAMES
        .get(usize::from(tag))
        .map_or_else(|| format!("tag_{tag}"), |s| (*s).to_string())
}

/// Maximum number of virtqueues this device can expose (inflate, deflate,
/// stats, reporting; free page hinting is never offered).
pub const MAX_QUEUES: usize = 4;

/// The role of a virtqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueRole {
    /// inflateq: PFNs of pages given to the device.
    Inflate,
    /// deflateq: PFNs of pages taken back by the driver.
    Deflate,
    /// statsq: memory statistics buffer.
    Stats,
    /// reporting_vq: free page reports.
    Reporting,
}

/// Error of this module.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    /// The frontend used a queue index that does not exist for the
    /// negotiated features.
    #[error("virtqueue {index} does not exist with features {features:#x}")]
    NoSuchQueue {
        /// queue index used
        index: usize,
        /// negotiated features
        features: u64,
    },
}

/// Ordered list of the virtqueues that exist for the negotiated `features`.
///
/// Virtqueues that are absent (statsq without `STATS_VQ`, free_page_vq
/// without `FREE_PAGE_HINT`, reporting_vq without `REPORTING`) do not take an
/// index: the following queues move down. This is what the Linux driver
/// (`init_vqs()` with `NULL` names, `vu_find_vqs()`/`vp_find_vqs()` counting
/// only named queues) and the virtio 1.3 clarification do.
pub fn queue_layout(features: u64) -> Vec<QueueRole> {
    let mut v = vec![QueueRole::Inflate, QueueRole::Deflate];
    if has(features, F_STATS_VQ) {
        v.push(QueueRole::Stats);
    }
    // free_page_vq would go here; FREE_PAGE_HINT is never offered.
    if has(features, F_REPORTING) {
        v.push(QueueRole::Reporting);
    }
    v
}

/// Role of virtqueue `index` for the negotiated `features`.
pub fn queue_role(features: u64, index: usize) -> Result<QueueRole, SpecError> {
    queue_layout(features)
        .get(index)
        .copied()
        .ok_or(SpecError::NoSuchQueue { index, features })
}

/// Index of the virtqueue with `role`, if it exists for `features`.
pub fn queue_index(features: u64, role: QueueRole) -> Option<usize> {
    queue_layout(features).iter().position(|r| *r == role)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_all_features() {
        let f = bit(F_STATS_VQ) | bit(F_REPORTING);
        assert_eq!(queue_role(f, 0), Ok(QueueRole::Inflate));
        assert_eq!(queue_role(f, 1), Ok(QueueRole::Deflate));
        assert_eq!(queue_role(f, 2), Ok(QueueRole::Stats));
        assert_eq!(queue_role(f, 3), Ok(QueueRole::Reporting));
        assert!(queue_role(f, 4).is_err());
    }

    #[test]
    fn layout_compacts_missing_queues() {
        let f = bit(F_REPORTING);
        assert_eq!(queue_role(f, 2), Ok(QueueRole::Reporting));
        assert_eq!(queue_index(f, QueueRole::Stats), None);
        assert_eq!(queue_layout(0).len(), 2);
        assert_eq!(queue_index(bit(F_STATS_VQ), QueueRole::Stats), Some(2));
    }

    #[test]
    fn feature_names_and_bitmap_len() {
        let n = feature_names(bit(F_DEVICE_INIT_REPORTED) | bit(F_DEVICE_INIT_ON_INFLATE));
        assert_eq!(n, vec!["DEVICE_INIT_REPORTED", "DEVICE_INIT_ON_INFLATE"]);
        assert_eq!(inflate_bitmap_len(0), 0);
        assert_eq!(inflate_bitmap_len(1), 1);
        assert_eq!(inflate_bitmap_len(8), 1);
        assert_eq!(inflate_bitmap_len(9), 2);
    }

    #[test]
    fn stat_names() {
        assert_eq!(stat_name(4), "free_memory");
        assert_eq!(stat_name(99), "tag_99");
    }
}
