//! Pure helpers for everything the guest controls: PFN arrays, reported
//! ranges, stats payloads and config-space writes. Nothing here touches
//! memory; the functions are unit tested and fuzzed (`fuzz/`).

use serde::Serialize;
use thiserror::Error;

use crate::spec::{self, CONFIG_SIZE, PAGE_SIZE, PFN_SHIFT, STAT_ENTRY_SIZE};

/// Error of this module: malformed guest-supplied payloads.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RangeError {
    /// A PFN array whose length is not a multiple of 4 bytes.
    #[error("PFN array of {0} bytes is not a multiple of 4")]
    PfnArrayLength(usize),
    /// A stats buffer whose length is not a multiple of 10 bytes.
    #[error("stats buffer of {0} bytes is not a multiple of {STAT_ENTRY_SIZE}")]
    StatsLength(usize),
    /// A config write that covers no driver-writable byte (only
    /// device-owned fields, or only bytes past the structure).
    #[error("config write at offset {offset} len {len} touches no driver-writable field")]
    ConfigReadOnly {
        /// offset of the write
        offset: u32,
        /// length of the write
        len: usize,
    },
}

/// A guest-physical byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct GuestRange {
    /// First guest-physical address.
    pub gpa: u64,
    /// Length in bytes.
    pub len: u64,
}

impl GuestRange {
    /// Creates a range.
    pub const fn new(gpa: u64, len: u64) -> Self {
        Self { gpa, len }
    }

    /// Exclusive end, `None` on overflow.
    pub fn end(&self) -> Option<u64> {
        self.gpa.checked_add(self.len)
    }
}

/// A guest memory region as shared by the frontend (SET_MEM_TABLE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionInfo {
    /// Guest-physical start.
    pub gpa: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Why a guest-supplied range was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectReason {
    /// Zero length.
    Empty,
    /// `gpa + len` overflows 64 bits.
    Overflow,
    /// Start or length not aligned to the device page size.
    Unaligned,
    /// Not (wholly) inside any region of guest memory.
    OutsideMemory,
    /// Starts in one region and ends in another one (or in a hole).
    CrossesRegion,
    /// The descriptor chain itself was malformed (bad descriptor, PFN array
    /// of odd length, too long).
    Malformed,
}

impl RejectReason {
    /// All reasons, for counters.
    pub const ALL: [RejectReason; 6] = [
        RejectReason::Empty,
        RejectReason::Overflow,
        RejectReason::Unaligned,
        RejectReason::OutsideMemory,
        RejectReason::CrossesRegion,
        RejectReason::Malformed,
    ];
}

/// Parses a little-endian `u32` PFN array (inflateq/deflateq payload).
pub fn parse_pfns(bytes: &[u8]) -> Result<Vec<u32>, RangeError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(RangeError::PfnArrayLength(bytes.len()));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Converts PFNs (4 KiB units) to one range per PFN.
pub fn pfns_to_ranges(pfns: &[u32]) -> Vec<GuestRange> {
    pfns.iter()
        .map(|&p| GuestRange::new(u64::from(p) << PFN_SHIFT, PAGE_SIZE))
        .collect()
}

/// Checks that `range` is non-empty, aligned to `align` (a power of two) and
/// lies wholly inside ONE of `regions`. Returns the index of that region.
/// Ranges are never clamped: a range that is only partly inside is rejected.
pub fn validate(
    range: GuestRange,
    regions: &[RegionInfo],
    align: u64,
) -> Result<usize, RejectReason> {
    if range.len == 0 {
        return Err(RejectReason::Empty);
    }
    let end = range.end().ok_or(RejectReason::Overflow)?;
    if align == 0 || !range.gpa.is_multiple_of(align) || !range.len.is_multiple_of(align) {
        return Err(RejectReason::Unaligned);
    }
    let start_region = regions.iter().position(|r| {
        range.gpa >= r.gpa
            && r.gpa
                .checked_add(r.len)
                .is_some_and(|rend| range.gpa < rend)
    });
    match start_region {
        None => Err(RejectReason::OutsideMemory),
        Some(i) => {
            let r = regions[i];
            let rend = r.gpa.saturating_add(r.len);
            if end <= rend {
                Ok(i)
            } else if regions
                .iter()
                .any(|o| o.gpa < end && o.gpa.saturating_add(o.len) >= end && o.gpa >= rend)
            {
                Err(RejectReason::CrossesRegion)
            } else {
                Err(RejectReason::OutsideMemory)
            }
        }
    }
}

/// Sorts ranges that belong to the same region and merges overlapping or
/// adjacent ones. Input pairs are `(region index, range)`; ranges of
/// different regions are never merged, even when physically adjacent.
pub fn coalesce(mut ranges: Vec<(usize, GuestRange)>) -> Vec<(usize, GuestRange)> {
    ranges.sort_unstable_by_key(|(i, r)| (*i, r.gpa, r.len));
    let mut out: Vec<(usize, GuestRange)> = Vec::with_capacity(ranges.len());
    for (idx, r) in ranges {
        if let Some((lidx, last)) = out.last_mut() {
            // Both ranges were validated, so `end()` cannot overflow here.
            let last_end = last.gpa.saturating_add(last.len);
            if *lidx == idx && r.gpa <= last_end {
                let new_end = last_end.max(r.gpa.saturating_add(r.len));
                last.len = new_end - last.gpa;
                continue;
            }
        }
        out.push((idx, r));
    }
    out
}

/// Result of validating and coalescing a batch of guest ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Valid, coalesced ranges with the index of their region.
    pub ranges: Vec<(usize, GuestRange)>,
    /// Rejected input ranges and why.
    pub rejects: Vec<(GuestRange, RejectReason)>,
}

impl Plan {
    /// Total bytes of the valid ranges.
    pub fn valid_bytes(&self) -> u64 {
        self.ranges.iter().map(|(_, r)| r.len).sum()
    }
}

/// Validates every range against `regions` (alignment `align`) and coalesces
/// the valid ones.
pub fn plan(ranges: &[GuestRange], regions: &[RegionInfo], align: u64) -> Plan {
    let mut ok = Vec::with_capacity(ranges.len());
    let mut rejects = Vec::new();
    for &r in ranges {
        match validate(r, regions, align) {
            Ok(i) => ok.push((i, r)),
            Err(e) => rejects.push((r, e)),
        }
    }
    Plan {
        ranges: coalesce(ok),
        rejects,
    }
}

/// Full pipeline for an inflateq/deflateq buffer: bytes -> PFNs -> ranges ->
/// validated, coalesced plan. Returns the plan and the number of PFNs.
pub fn plan_pfn_buffer(bytes: &[u8], regions: &[RegionInfo]) -> Result<(Plan, usize), RangeError> {
    let pfns = parse_pfns(bytes)?;
    let ranges = pfns_to_ranges(&pfns);
    Ok((plan(&ranges, regions, PAGE_SIZE), pfns.len()))
}

/// The inflate bitmap of a chain under `F_DEVICE_INIT_ON_INFLATE`: bit N
/// (LSB first within byte N / 8) is set when PFN N (index in the chain's
/// array) is a valid page of guest memory and no part of it lies in
/// `uninitialized`, the ranges the device could not initialize. Duplicate
/// PFNs get the same answer.
pub fn inflate_bitmap(
    pfns: &[u32],
    regions: &[RegionInfo],
    uninitialized: &[GuestRange],
) -> Vec<u8> {
    let failed = disjoint_spans(uninitialized);
    let mut out = vec![0u8; spec::inflate_bitmap_len(pfns.len())];
    for (i, page) in pfns_to_ranges(pfns).into_iter().enumerate() {
        let valid = validate(page, regions, PAGE_SIZE).is_ok();
        if valid && !overlaps_any(&failed, page) {
            out[i / 8] |= 1 << (i % 8);
        }
    }
    out
}

/// `ranges` as sorted, disjoint `[start, end)` spans (overlapping and
/// adjacent ones merged). Empty ranges and ranges whose end overflows are
/// left out: they overlap nothing (see [`overlaps`]).
fn disjoint_spans(ranges: &[GuestRange]) -> Vec<(u64, u64)> {
    let mut spans: Vec<(u64, u64)> = ranges
        .iter()
        .filter(|r| r.len > 0)
        .filter_map(|r| Some((r.gpa, r.end()?)))
        .collect();
    spans.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(spans.len());
    for (start, end) in spans {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// Whether `r` shares a byte with one of the sorted, disjoint `spans`
/// (binary search: their ends are sorted too).
fn overlaps_any(spans: &[(u64, u64)], r: GuestRange) -> bool {
    let Some(end) = r.end() else {
        return false;
    };
    if r.len == 0 {
        return false;
    }
    let i = spans.partition_point(|&(_, e)| e <= r.gpa);
    spans.get(i).is_some_and(|&(s, _)| s < end)
}

/// Whether two ranges share at least one byte.
pub fn overlaps(a: GuestRange, b: GuestRange) -> bool {
    let (Some(ae), Some(be)) = (a.end(), b.end()) else {
        return false;
    };
    a.len > 0 && b.len > 0 && a.gpa < be && b.gpa < ae
}

/// Used length of a reporting_vq element under `F_DEVICE_INIT_REPORTED`:
/// the total length of its buffers (`buffer_lens`) when every page was
/// initialized, 0 otherwise (also when the total does not fit in 32 bits).
pub fn report_used_len(buffer_lens: &[u32], all_initialized: bool) -> u32 {
    if !all_initialized {
        return 0;
    }
    buffer_lens
        .iter()
        .try_fold(0u32, |acc, &l| acc.checked_add(l))
        .unwrap_or(0)
}

/// Splits a range into the part made of whole backing pages of size
/// `page_size` (power of two) and the partial head/tail that is not.
/// Returns `(whole, partial)`.
pub fn split_to_pages(range: GuestRange, page_size: u64) -> (Option<GuestRange>, Vec<GuestRange>) {
    let Some(end) = range.end() else {
        return (None, vec![range]);
    };
    if page_size <= 1 || !page_size.is_power_of_two() {
        return (Some(range), Vec::new());
    }
    let mask = page_size - 1;
    let start_up = match range.gpa.checked_add(mask) {
        Some(v) => v & !mask,
        None => return (None, vec![range]),
    };
    let end_down = end & !mask;
    if start_up >= end_down {
        return (None, vec![range]);
    }
    let mut partial = Vec::new();
    if start_up > range.gpa {
        partial.push(GuestRange::new(range.gpa, start_up - range.gpa));
    }
    if end > end_down {
        partial.push(GuestRange::new(end_down, end - end_down));
    }
    (
        Some(GuestRange::new(start_up, end_down - start_up)),
        partial,
    )
}

/// One memory statistic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// `VIRTIO_BALLOON_S_*` tag.
    pub tag: u16,
    /// Value (bytes or counts, per tag).
    pub val: u64,
}

/// Parses a statsq buffer: an array of packed `{le16 tag; le64 val}`.
pub fn parse_stats(bytes: &[u8]) -> Result<Vec<Stat>, RangeError> {
    if !bytes.len().is_multiple_of(STAT_ENTRY_SIZE) {
        return Err(RangeError::StatsLength(bytes.len()));
    }
    Ok(bytes
        .chunks_exact(STAT_ENTRY_SIZE)
        .map(|c| {
            let mut v = [0u8; 8];
            v.copy_from_slice(&c[2..10]);
            Stat {
                tag: u16::from_le_bytes([c[0], c[1]]),
                val: u64::from_le_bytes(v),
            }
        })
        .collect())
}

/// The balloon configuration space.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct BalloonConfig {
    /// Target number of 4 KiB pages in the balloon (device writes).
    pub num_pages: u32,
    /// Number of pages in the balloon (driver writes).
    pub actual: u32,
    /// Free page hint command id (unused, always 0).
    pub free_page_hint_cmd_id: u32,
    /// Poison value (driver writes, valid with PAGE_POISON).
    pub poison_val: u32,
}

impl BalloonConfig {
    /// Little-endian byte image.
    pub fn to_bytes(&self) -> [u8; CONFIG_SIZE] {
        let mut b = [0u8; CONFIG_SIZE];
        b[spec::CFG_NUM_PAGES..spec::CFG_NUM_PAGES + 4]
            .copy_from_slice(&self.num_pages.to_le_bytes());
        b[spec::CFG_ACTUAL..spec::CFG_ACTUAL + 4].copy_from_slice(&self.actual.to_le_bytes());
        b[spec::CFG_FREE_PAGE_HINT_CMD_ID..spec::CFG_FREE_PAGE_HINT_CMD_ID + 4]
            .copy_from_slice(&self.free_page_hint_cmd_id.to_le_bytes());
        b[spec::CFG_POISON_VAL..spec::CFG_POISON_VAL + 4]
            .copy_from_slice(&self.poison_val.to_le_bytes());
        b
    }

    /// Parses a little-endian byte image.
    pub fn from_bytes(b: &[u8; CONFIG_SIZE]) -> Self {
        let rd = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Self {
            num_pages: rd(spec::CFG_NUM_PAGES),
            actual: rd(spec::CFG_ACTUAL),
            free_page_hint_cmd_id: rd(spec::CFG_FREE_PAGE_HINT_CMD_ID),
            poison_val: rd(spec::CFG_POISON_VAL),
        }
    }

    /// `size` bytes of config space from `offset` (GET_CONFIG). Bytes past
    /// the end of the structure read as zero, so the reply always has
    /// exactly the requested size (the vhost-user frontend checks that).
    pub fn read(&self, offset: u32, size: u32) -> Vec<u8> {
        let img = self.to_bytes();
        (0..size)
            .map(|i| {
                u64::from(offset)
                    .checked_add(u64::from(i))
                    .and_then(|o| usize::try_from(o).ok())
                    .and_then(|o| img.get(o).copied())
                    .unwrap_or(0)
            })
            .collect()
    }

    /// Applies a driver write (SET_CONFIG). The bytes that fall into the
    /// driver-writable fields (`actual`, `poison_val`) are taken, partial
    /// writes inside them merged; bytes of the device-owned fields
    /// (`num_pages`, `free_page_hint_cmd_id`) and past the structure are
    /// ignored. QEMU's generic vhost-user-device writes the whole config
    /// space (its cached copy, with the guest's change in it) on every guest
    /// write, so a write that also covers device-owned fields is normal. A
    /// write with no driver-writable byte at all is an error and changes
    /// nothing.
    pub fn apply_write(&self, offset: u32, data: &[u8]) -> Result<ConfigWrite, RangeError> {
        let writable = |o: u64| {
            let in_field = |f: usize| (f as u64..f as u64 + 4).contains(&o);
            in_field(spec::CFG_ACTUAL) || in_field(spec::CFG_POISON_VAL)
        };
        let mut img = self.to_bytes();
        let mut taken = 0;
        for (i, &b) in data.iter().enumerate() {
            let o = u64::from(offset) + i as u64;
            if writable(o) {
                // writable offsets are < CONFIG_SIZE
                if let Some(slot) = usize::try_from(o).ok().and_then(|o| img.get_mut(o)) {
                    *slot = b;
                    taken += 1;
                }
            }
        }
        if taken == 0 {
            return Err(RangeError::ConfigReadOnly {
                offset,
                len: data.len(),
            });
        }
        Ok(ConfigWrite {
            config: Self::from_bytes(&img),
            ignored: data.len() - taken,
        })
    }
}

/// Result of [`BalloonConfig::apply_write`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConfigWrite {
    /// The config space after the write.
    pub config: BalloonConfig,
    /// Bytes of the write that were ignored (device-owned fields, past the
    /// structure).
    pub ignored: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn regions() -> Vec<RegionInfo> {
        vec![
            RegionInfo {
                gpa: 0,
                len: 16 * MIB,
            },
            RegionInfo {
                gpa: 16 * MIB,
                len: 16 * MIB,
            },
            RegionInfo {
                gpa: 64 * MIB,
                len: 4 * MIB,
            },
        ]
    }

    #[test]
    fn pfn_parsing() {
        assert_eq!(parse_pfns(&[1, 0, 0, 0, 2, 0, 0, 0]).unwrap(), vec![1, 2]);
        assert_eq!(parse_pfns(&[]).unwrap(), Vec::<u32>::new());
        assert_eq!(parse_pfns(&[1, 2, 3]), Err(RangeError::PfnArrayLength(3)));
        let r = pfns_to_ranges(&[0xffff_ffff]);
        assert_eq!(r[0], GuestRange::new(0xffff_ffffu64 << 12, 4096));
    }

    #[test]
    fn inflate_bitmaps() {
        let rg = regions();
        let p = |a: u64| (a >> PFN_SHIFT) as u32;
        // 9 PFNs: two bytes; PFN 1 outside memory, PFN 8 uninitialized
        let pfns = [
            p(0),
            p(40 * MIB),
            p(4096),
            p(8192),
            p(0),
            p(MIB),
            p(2 * MIB),
            p(3 * MIB),
            p(5 * MIB),
        ];
        let failed = [GuestRange::new(5 * MIB, 4096)];
        assert_eq!(inflate_bitmap(&pfns, &rg, &failed), vec![0b1111_1101, 0]);
        assert_eq!(inflate_bitmap(&pfns, &rg, &[]), vec![0b1111_1101, 1]);
        assert_eq!(inflate_bitmap(&[], &rg, &[]), Vec::<u8>::new());
        // a failed range covering part of a page clears that page
        let part = [GuestRange::new(4096 + 100, 8)];
        assert_eq!(inflate_bitmap(&[p(4096)], &rg, &part), vec![0]);
        // empty and overflowing failed ranges overlap nothing; one that
        // ends where the page starts does not clear it
        let odd = [
            GuestRange::new(4096, 0),
            GuestRange::new(u64::MAX - 10, 100),
            GuestRange::new(0, 4096),
        ];
        assert_eq!(inflate_bitmap(&[p(4096)], &rg, &odd), vec![1]);
    }

    /// 65,536 PFNs (the most an inflate chain holds) with 32,768 failed
    /// ranges, unsorted and overlapping: correct, and not quadratic (that
    /// took 0.4 s in a release build, minutes in a debug one).
    #[test]
    fn inflate_bitmap_with_many_failed_ranges() {
        let rg = [RegionInfo {
            gpa: 0,
            len: 1 << 30,
        }];
        // every other page; the pages of odd index failed
        let pfns: Vec<u32> = (0..65_536u32).map(|i| 2 * i).collect();
        let mut failed: Vec<GuestRange> = (0..65_536u64)
            .filter(|i| i % 2 == 1)
            .map(|i| GuestRange::new(2 * i * 4096 + 8, 16))
            .rev()
            .collect();
        // overlapping duplicates and a range that ends inside the next page
        failed.push(GuestRange::new(2 * 4097 * 4096, 4096));
        failed.push(GuestRange::new(2 * 4096 - 1, 1));
        let t = std::time::Instant::now();
        let map = inflate_bitmap(&pfns, &rg, &failed);
        let took = t.elapsed();
        for (i, byte) in map.iter().enumerate() {
            assert_eq!(*byte, 0b0101_0101, "byte {i}");
        }
        assert!(
            took < std::time::Duration::from_secs(2),
            "inflate_bitmap took {took:?}"
        );
    }

    #[test]
    fn report_used_lengths() {
        assert_eq!(report_used_len(&[4096, 8192], true), 12288);
        assert_eq!(report_used_len(&[4096, 8192], false), 0);
        assert_eq!(report_used_len(&[u32::MAX, 1], true), 0);
        assert!(overlaps(GuestRange::new(0, 2), GuestRange::new(1, 1)));
        assert!(!overlaps(GuestRange::new(0, 1), GuestRange::new(1, 1)));
        assert!(!overlaps(GuestRange::new(0, 0), GuestRange::new(0, 1)));
    }

    #[test]
    fn validation() {
        let rg = regions();
        assert_eq!(validate(GuestRange::new(0, 4096), &rg, 4096), Ok(0));
        assert_eq!(
            validate(GuestRange::new(16 * MIB - 4096, 4096), &rg, 4096),
            Ok(0)
        );
        assert_eq!(
            validate(GuestRange::new(0, 0), &rg, 4096),
            Err(RejectReason::Empty)
        );
        assert_eq!(
            validate(GuestRange::new(1, 4096), &rg, 4096),
            Err(RejectReason::Unaligned)
        );
        assert_eq!(
            validate(GuestRange::new(0, 100), &rg, 4096),
            Err(RejectReason::Unaligned)
        );
        assert_eq!(
            validate(GuestRange::new(u64::MAX - 4095, 8192), &rg, 4096),
            Err(RejectReason::Overflow)
        );
        assert_eq!(
            validate(GuestRange::new(40 * MIB, 4096), &rg, 4096),
            Err(RejectReason::OutsideMemory)
        );
        // crosses from region 0 into region 1: rejected, not clamped
        assert_eq!(
            validate(GuestRange::new(16 * MIB - 4096, 8192), &rg, 4096),
            Err(RejectReason::CrossesRegion)
        );
        // runs off the end of region 2 into nothing
        assert_eq!(
            validate(GuestRange::new(68 * MIB - 4096, 8192), &rg, 4096),
            Err(RejectReason::OutsideMemory)
        );
        // starts before region 2 in a hole
        assert_eq!(
            validate(GuestRange::new(64 * MIB - 4096, 8192), &rg, 4096),
            Err(RejectReason::OutsideMemory)
        );
    }

    #[test]
    fn coalescing() {
        let c = coalesce(vec![
            (0, GuestRange::new(8192, 4096)),
            (0, GuestRange::new(0, 4096)),
            (0, GuestRange::new(4096, 4096)),
            (0, GuestRange::new(4096, 4096)), // duplicate
            (0, GuestRange::new(20480, 4096)),
            (1, GuestRange::new(16 * MIB, 4096)),
        ]);
        assert_eq!(
            c,
            vec![
                (0, GuestRange::new(0, 12288)),
                (0, GuestRange::new(20480, 4096)),
                (1, GuestRange::new(16 * MIB, 4096)),
            ]
        );
        // physically adjacent but different regions: not merged
        let c = coalesce(vec![
            (0, GuestRange::new(16 * MIB - 4096, 4096)),
            (1, GuestRange::new(16 * MIB, 4096)),
        ]);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn pfn_plan() {
        let mut bytes = Vec::new();
        for pfn in [3u32, 1, 2, 0x10_0000, 5] {
            bytes.extend_from_slice(&pfn.to_le_bytes());
        }
        let (p, n) = plan_pfn_buffer(&bytes, &regions()).unwrap();
        assert_eq!(n, 5);
        assert_eq!(
            p.ranges,
            vec![
                (0, GuestRange::new(4096, 3 * 4096)),
                (0, GuestRange::new(5 * 4096, 4096))
            ]
        );
        assert_eq!(
            p.rejects,
            vec![(GuestRange::new(1 << 32, 4096), RejectReason::OutsideMemory)]
        );
        assert_eq!(p.valid_bytes(), 4 * 4096);
    }

    #[test]
    fn huge_page_split() {
        let two_m = 2 * MIB;
        let (w, p) = split_to_pages(GuestRange::new(0, 4 * MIB), two_m);
        assert_eq!(w, Some(GuestRange::new(0, 4 * MIB)));
        assert!(p.is_empty());
        let (w, p) = split_to_pages(GuestRange::new(MIB, 4 * MIB), two_m);
        assert_eq!(w, Some(GuestRange::new(two_m, two_m)));
        assert_eq!(
            p,
            vec![GuestRange::new(MIB, MIB), GuestRange::new(4 * MIB, MIB)]
        );
        let (w, p) = split_to_pages(GuestRange::new(4096, 4096), two_m);
        assert_eq!(w, None);
        assert_eq!(p, vec![GuestRange::new(4096, 4096)]);
        let (w, _) = split_to_pages(GuestRange::new(4096, 4096), 4096);
        assert_eq!(w, Some(GuestRange::new(4096, 4096)));
        // found by the fuzzer: an overflowing range is never "whole"
        let (w, p) = split_to_pages(GuestRange::new(u64::MAX, 2), 1);
        assert_eq!((w, p), (None, vec![GuestRange::new(u64::MAX, 2)]));
    }

    #[test]
    fn stats_parsing() {
        let mut b = vec![4u8, 0];
        b.extend_from_slice(&1234u64.to_le_bytes());
        b.extend_from_slice(&[5, 0]);
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(
            parse_stats(&b).unwrap(),
            vec![
                Stat { tag: 4, val: 1234 },
                Stat {
                    tag: 5,
                    val: u64::MAX
                }
            ]
        );
        assert_eq!(parse_stats(&b[..11]), Err(RangeError::StatsLength(11)));
    }

    #[test]
    fn config_space() {
        let c = BalloonConfig {
            num_pages: 0x100,
            actual: 2,
            free_page_hint_cmd_id: 0,
            poison_val: 0,
        };
        assert_eq!(c.read(0, 4), vec![0, 1, 0, 0]);
        assert_eq!(c.read(14, 4), vec![0, 0, 0, 0]);
        assert_eq!(c.read(u32::MAX, 2), vec![0, 0]);
        let n = c.apply_write(4, &7u32.to_le_bytes()).unwrap().config;
        assert_eq!(n.actual, 7);
        let n = n
            .apply_write(12, &0xaaaa_aaaau32.to_le_bytes())
            .unwrap()
            .config;
        assert_eq!(n.poison_val, 0xaaaa_aaaa);
        let n = n.apply_write(5, &[1]).unwrap().config;
        assert_eq!(n.actual, 0x107);
        // only device-owned bytes, or nothing inside the structure: refused
        for (off, data) in [(0, &[1u8, 2, 3, 4][..]), (8, &[0; 4]), (16, &[0; 4])] {
            assert_eq!(
                c.apply_write(off, data),
                Err(RangeError::ConfigReadOnly {
                    offset: off,
                    len: data.len()
                })
            );
        }
        assert!(c.apply_write(u32::MAX, &[0]).is_err());
        // straddling: the writable bytes are taken, the others ignored
        let w = c.apply_write(2, &[9; 4]).unwrap();
        assert_eq!((w.config.num_pages, w.config.actual), (0x100, 0x0909));
        assert_eq!(w.ignored, 2);
        let w = c.apply_write(14, &[0xff; 4]).unwrap();
        assert_eq!((w.config.poison_val, w.ignored), (0xffff_0000, 2));
    }

    #[test]
    fn whole_config_write_takes_the_driver_fields() {
        // QEMU's vhost-user-device: the whole (cached) 16 bytes every time
        let c = BalloonConfig {
            num_pages: 1000,
            ..Default::default()
        };
        let stale = BalloonConfig {
            num_pages: 5,
            actual: 123,
            free_page_hint_cmd_id: 9,
            poison_val: 0xaaaa_aaaa,
        };
        let w = c.apply_write(0, &stale.to_bytes()).unwrap();
        assert_eq!(
            w.config,
            BalloonConfig {
                num_pages: 1000,
                actual: 123,
                free_page_hint_cmd_id: 0,
                poison_val: 0xaaaa_aaaa,
            }
        );
        assert_eq!(w.ignored, 8);
        // a larger config space (vhost-user-device config-size) is fine too
        let mut big = stale.to_bytes().to_vec();
        big.extend_from_slice(&[0xee; 8]);
        assert_eq!(c.apply_write(0, &big).unwrap().config, w.config);
    }
}
