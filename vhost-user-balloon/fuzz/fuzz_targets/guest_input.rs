//! Fuzzes everything the guest controls, through the pure parsing and
//! validation functions: PFN arrays (inflateq/deflateq), the inflate bitmap
//! written back under bit 7, reported ranges and the used length under bit 6
//! (reporting_vq descriptors), stats payloads (statsq), config writes
//! (partial, whole-space as QEMU's vhost-user-device sends them, or larger)
//! and descriptor tables (the chains the device reads from a ring).
#![no_main]

use libfuzzer_sys::fuzz_target;
use vhost_user_balloon::chain::{Chain, DESC_F_INDIRECT, DESC_F_NEXT, DESC_SIZE};
use vhost_user_balloon::discard::GuestMem;
use vhost_user_balloon::ranges::{
    self, split_to_pages, BalloonConfig, GuestRange, RegionInfo, RejectReason,
};
use vhost_user_balloon::spec::{self, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress};

/// Guest memory for the descriptor-table case: one 64 KiB region at 0.
const TABLE_MEM: usize = 64 * 1024;

fn u64_at(d: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    for (k, x) in b.iter_mut().enumerate() {
        *x = d.get(i + k).copied().unwrap_or(0);
    }
    u64::from_le_bytes(b)
}

fn check_plan(plan: &ranges::Plan, regions: &[RegionInfo]) {
    for (idx, r) in &plan.ranges {
        let reg = regions[*idx];
        // every accepted range is aligned and wholly inside its region
        assert!(r.len > 0 && r.gpa % PAGE_SIZE == 0 && r.len % PAGE_SIZE == 0);
        assert!(r.gpa >= reg.gpa);
        assert!(r.gpa + r.len <= reg.gpa + reg.len);
    }
    // coalesced output is sorted and non-overlapping per region
    for w in plan.ranges.windows(2) {
        if w[0].0 == w[1].0 {
            assert!(w[0].1.gpa + w[0].1.len < w[1].1.gpa);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let sel = data[0] % 8;
    let body = &data[1..];
    // Two regions with a hole between them, like UML's highmem layout.
    let regions = [
        RegionInfo { gpa: 0x20_0000, len: 0x400_0000 },
        RegionInfo { gpa: 0x1_0000_0000, len: 0x10_0000 },
    ];
    match sel {
        0 => {
            if let Ok((plan, n)) = ranges::plan_pfn_buffer(body, &regions) {
                assert_eq!(n, body.len() / 4);
                check_plan(&plan, &regions);
                let rejected = plan.rejects.len() as u64 * PAGE_SIZE;
                assert!(plan.valid_bytes() + rejected <= n as u64 * PAGE_SIZE);
            }
        }
        1 => {
            let rs: Vec<GuestRange> = body
                .chunks(12)
                .map(|c| GuestRange::new(u64_at(c, 0), u64_at(c, 8) & 0xffff_ffff))
                .collect();
            let plan = ranges::plan(&rs, &regions, PAGE_SIZE);
            check_plan(&plan, &regions);
            for (r, why) in &plan.rejects {
                assert!(ranges::validate(*r, &regions, PAGE_SIZE) == Err(*why));
                assert!(RejectReason::ALL.contains(why));
            }
        }
        2 => {
            if let Ok(stats) = ranges::parse_stats(body) {
                assert_eq!(stats.len() * spec::STAT_ENTRY_SIZE, body.len());
                for s in stats {
                    let _ = spec::stat_name(s.tag);
                }
            }
        }
        3 => {
            let off = u32::from_le_bytes([body[0], body[1], body[2], 0]) % 40;
            let cfg = BalloonConfig { num_pages: 7, actual: 1, free_page_hint_cmd_id: 0, poison_val: 0 };
            let data = &body[3..];
            match cfg.apply_write(off, data) {
                Ok(w) => {
                    // device-owned fields never change
                    assert_eq!(w.config.num_pages, 7);
                    assert_eq!(w.config.free_page_hint_cmd_id, 0);
                    assert!(w.ignored < data.len());
                    // the driver-writable bytes of the write are taken
                    let img = w.config.to_bytes();
                    for (i, &b) in data.iter().enumerate() {
                        let o = off as usize + i;
                        if (4..8).contains(&o) || (12..16).contains(&o) {
                            assert_eq!(img[o], b);
                        }
                    }
                }
                Err(_) => {
                    // nothing driver-writable in the write
                    let hits = (0..data.len())
                        .map(|i| off as usize + i)
                        .any(|o| (4..8).contains(&o) || (12..16).contains(&o));
                    assert!(!hits);
                }
            }
            let size = u32::from(body[1]);
            assert_eq!(cfg.read(off, size).len(), size as usize);
        }
        5 => {
            // inflate bitmap (bit 7): PFNs from the first half, ranges the
            // device failed to initialize from the second half
            let (a, b) = body.split_at(body.len() / 2);
            let pfns: Vec<u32> = a
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let failed: Vec<GuestRange> = b
                .chunks(16)
                .map(|c| GuestRange::new(u64_at(c, 0), u64_at(c, 8) & 0xff_ffff))
                .collect();
            let map = ranges::inflate_bitmap(&pfns, &regions, &failed);
            assert_eq!(map.len(), spec::inflate_bitmap_len(pfns.len()));
            for (i, page) in ranges::pfns_to_ranges(&pfns).into_iter().enumerate() {
                let set = map[i / 8] & (1 << (i % 8)) != 0;
                if set {
                    // only valid pages the device initialized
                    assert!(ranges::validate(page, &regions, PAGE_SIZE).is_ok());
                    assert!(!failed.iter().any(|f| ranges::overlaps(*f, page)));
                }
            }
            // no bit past the last PFN
            if pfns.len() % 8 != 0 {
                let last = map[map.len() - 1];
                assert_eq!(last >> (pfns.len() % 8), 0);
            }
        }
        6 => {
            // used length of a report (bit 6)
            let lens: Vec<u32> = body
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
            let used = ranges::report_used_len(&lens, true);
            assert!(u64::from(used) == total || (used == 0 && total > u64::from(u32::MAX)));
            assert_eq!(ranges::report_used_len(&lens, false), 0);
        }
        7 => {
            // a descriptor table: ring size (a power of two up to 1024),
            // head, then the table itself from guest address 0
            let size = 1u16 << (body[0] % 11);
            let head = u16::from_le_bytes([body[1], body[2]]);
            let table = &body[3..body.len().min(TABLE_MEM + 3)];
            let mem = match GuestMem::from_ranges(&[(GuestAddress(0), TABLE_MEM)]) {
                Ok(m) => m,
                Err(_) => return,
            };
            mem.write_slice(table, GuestAddress(0)).unwrap();
            if let Ok(c) = Chain::read(&mem, 0, size, head) {
                // never longer than the ring, never more than 4 GiB, and
                // every descriptor came from the ring's own table along its
                // next fields, none of them indirect
                assert!(head < size);
                assert!(!c.descs.is_empty() && c.descs.len() <= usize::from(size));
                let total: u64 = c.descs.iter().map(|d| u64::from(d.len)).sum();
                assert!(total <= u64::from(u32::MAX));
                let mut index = head;
                for (k, d) in c.descs.iter().enumerate() {
                    let at = usize::from(index) * DESC_SIZE as usize;
                    let raw: Vec<u8> = (at..at + 16)
                        .map(|i| table.get(i).copied().unwrap_or(0))
                        .collect();
                    assert_eq!(d.addr, u64_at(&raw, 0));
                    assert_eq!(u64::from(d.len), u64_at(&raw, 8) & 0xffff_ffff);
                    let flags = u16::from_le_bytes([raw[12], raw[13]]);
                    assert_eq!(flags & DESC_F_INDIRECT, 0);
                    let last = k + 1 == c.descs.len();
                    assert_eq!(flags & DESC_F_NEXT == 0, last);
                    index = u16::from_le_bytes([raw[14], raw[15]]);
                }
            }
        }
        _ => {
            let r = GuestRange::new(u64_at(body, 0), u64_at(body, 8));
            let page = 1u64 << (u64_at(body, 16) % 31);
            let (whole, partial) = split_to_pages(r, page);
            let total: u64 = whole.map_or(0, |w| w.len) + partial.iter().map(|p| p.len).sum::<u64>();
            if r.end().is_some() {
                assert_eq!(total, r.len);
            }
            if let Some(w) = whole {
                assert!(w.gpa % page == 0 && w.len % page == 0);
                assert!(w.gpa >= r.gpa && w.gpa + w.len <= r.gpa + r.len);
            }
        }
    }
});
