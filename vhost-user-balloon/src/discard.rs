//! The host-side effect of inflating / reporting: giving guest pages back to
//! the host so that they read as zero afterwards.
//!
//! * fd-backed regions (memfd, tmpfs, hugetlbfs — everything the frontend
//!   shares with SET_MEM_TABLE): `fallocate(PUNCH_HOLE | KEEP_SIZE)` on the
//!   file, aligned to the backing page size of the file system (the huge page
//!   size on hugetlbfs). Punching a hole also zaps the page from every shared
//!   mapping, ours and the guest's. If the file system does not support
//!   hole punching, `madvise(MADV_REMOVE)` on our shared mapping is tried.
//!   For a MAP_PRIVATE file mapping the private copy is dropped as well
//!   (`MADV_DONTNEED`).
//! * anonymous regions (unit tests): `MADV_DONTNEED` for private mappings
//!   (reads back zero-filled pages), `MADV_REMOVE` for shared ones.
//!
//! A part of a range that does not cover a whole backing page (4 KiB pages on
//! a hugetlbfs region) cannot be discarded: it is skipped and counted, or —
//! when the caller promised the guest zeroes (feature bits 6/7) — explicitly
//! overwritten with zeroes.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::Mutex;

use thiserror::Error;
use vm_memory::{
    Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryError, GuestMemoryMmap, GuestMemoryRegion,
};

use crate::ranges::{split_to_pages, GuestRange};
use crate::spec::PAGE_SIZE;

const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Error of this module.
#[derive(Debug, Error)]
pub enum DiscardError {
    /// The range is not wholly inside one mapped region (should have been
    /// rejected by validation before).
    #[error("range {gpa:#x}+{len:#x} is not inside one mapped region")]
    NotMapped {
        /// guest-physical address
        gpa: u64,
        /// length
        len: u64,
    },
    /// A system call failed.
    #[error("{op} on {gpa:#x}+{len:#x} failed: {source}")]
    Syscall {
        /// which call
        op: &'static str,
        /// guest-physical address
        gpa: u64,
        /// length
        len: u64,
        /// OS error
        source: io::Error,
    },
    /// Writing zeroes into a partial page failed.
    #[error("zero-filling {gpa:#x} failed: {source}")]
    ZeroFill {
        /// guest-physical address
        gpa: u64,
        /// cause
        source: GuestMemoryError,
    },
}

/// What a discard did with the bytes of a range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiscardOutcome {
    /// Bytes released to the host.
    pub discarded: u64,
    /// Bytes overwritten with zeroes instead.
    pub zero_filled: u64,
    /// Bytes left untouched (partial huge pages, no zero guarantee).
    pub skipped: u64,
}

/// The host-side effect behind inflate and free page reporting.
pub trait Discarder: Send + Sync {
    /// True when a discarded range reads back as zero (required before the
    /// device may offer feature bits 6 and 7).
    fn leaves_zeroes(&self) -> bool;

    /// Discards `range`, which the caller validated to lie in one region of
    /// `mem`. With `zero_fill_partial`, bytes that cannot be discarded are
    /// overwritten with zeroes so that the whole range reads as zero.
    fn discard(
        &self,
        mem: &GuestMemoryMmap,
        range: GuestRange,
        zero_fill_partial: bool,
    ) -> Result<DiscardOutcome, DiscardError>;
}

/// The real implementation (see module documentation).
#[derive(Debug, Default)]
pub struct HostDiscarder;

/// Does nothing (for `--discard none`): pages stay populated.
#[derive(Debug, Default)]
pub struct NoopDiscarder;

impl Discarder for NoopDiscarder {
    fn leaves_zeroes(&self) -> bool {
        false
    }

    fn discard(
        &self,
        _mem: &GuestMemoryMmap,
        range: GuestRange,
        _zero_fill_partial: bool,
    ) -> Result<DiscardOutcome, DiscardError> {
        Ok(DiscardOutcome {
            skipped: range.len,
            ..Default::default()
        })
    }
}

/// Page size of the file behind `fd`: the huge page size on hugetlbfs,
/// 4 KiB otherwise.
fn fd_page_size(fd: &std::fs::File) -> u64 {
    // SAFETY: statfs is plain old data; fstatfs only writes into it.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd and valid out pointer.
    let rc = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) };
    #[allow(clippy::unnecessary_cast)]
    if rc == 0 && st.f_type as i64 == HUGETLBFS_MAGIC {
        u64::try_from(st.f_bsize)
            .unwrap_or(PAGE_SIZE)
            .max(PAGE_SIZE)
    } else {
        PAGE_SIZE
    }
}

fn to_off(v: u64, op: &'static str, range: GuestRange) -> Result<libc::off_t, DiscardError> {
    libc::off_t::try_from(v).map_err(|_| DiscardError::Syscall {
        op,
        gpa: range.gpa,
        len: range.len,
        source: io::Error::from_raw_os_error(libc::EOVERFLOW),
    })
}

fn madvise(
    ptr: *mut u8,
    len: u64,
    advice: libc::c_int,
    op: &'static str,
    range: GuestRange,
) -> Result<(), DiscardError> {
    let l = usize::try_from(len).map_err(|_| DiscardError::NotMapped {
        gpa: range.gpa,
        len: range.len,
    })?;
    // SAFETY: `ptr..ptr+len` lies inside a mapping owned by the guest memory
    // object (checked by the caller against the region bounds); madvise does
    // not invalidate the mapping itself, it only drops its contents.
    let rc = unsafe { libc::madvise(ptr.cast(), l, advice) };
    if rc != 0 {
        return Err(DiscardError::Syscall {
            op,
            gpa: range.gpa,
            len: range.len,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn zero_fill(mem: &GuestMemoryMmap, r: GuestRange) -> Result<(), DiscardError> {
    const CHUNK: u64 = 64 * 1024;
    let zeroes = [0u8; CHUNK as usize];
    let mut off = 0;
    while off < r.len {
        let n = (r.len - off).min(CHUNK);
        let idx = usize::try_from(n).unwrap_or(zeroes.len());
        mem.write_slice(&zeroes[..idx], GuestAddress(r.gpa + off))
            .map_err(|source| DiscardError::ZeroFill {
                gpa: r.gpa + off,
                source,
            })?;
        off += n;
    }
    Ok(())
}

impl Discarder for HostDiscarder {
    fn leaves_zeroes(&self) -> bool {
        true
    }

    fn discard(
        &self,
        mem: &GuestMemoryMmap,
        range: GuestRange,
        zero_fill_partial: bool,
    ) -> Result<DiscardOutcome, DiscardError> {
        let not_mapped = || DiscardError::NotMapped {
            gpa: range.gpa,
            len: range.len,
        };
        let region = mem
            .find_region(GuestAddress(range.gpa))
            .ok_or_else(not_mapped)?;
        let rstart = region.start_addr().0;
        let in_off = range.gpa - rstart;
        if in_off
            .checked_add(range.len)
            .is_none_or(|e| e > region.len())
        {
            return Err(not_mapped());
        }
        let fo = region.file_offset();
        // Align in the coordinate space of the backing object: the file
        // offset for fd-backed regions, the host address otherwise.
        let host_base = region.as_ptr() as u64;
        let (base, page) = match fo {
            Some(fo) => (fo.start(), fd_page_size(fo.file())),
            None => (host_base, PAGE_SIZE),
        };
        let (whole, partial) = split_to_pages(GuestRange::new(base + in_off, range.len), page);
        let mut out = DiscardOutcome::default();
        if let Some(w) = whole {
            let w_in = w.gpa - base; // offset inside the region
            let gpa_range = GuestRange::new(rstart + w_in, w.len);
            let ptr = region
                .as_ptr()
                .wrapping_add(usize::try_from(w_in).map_err(|_| not_mapped())?);
            match fo {
                Some(fo) => {
                    // SAFETY: fallocate on an fd we own (shared via Arc<File>)
                    // with bounds derived from the region's file offset.
                    let rc = unsafe {
                        libc::fallocate(
                            fo.file().as_raw_fd(),
                            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                            to_off(w.gpa, "fallocate", gpa_range)?,
                            to_off(w.len, "fallocate", gpa_range)?,
                        )
                    };
                    if rc != 0 {
                        let e = io::Error::last_os_error();
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)
                        ) {
                            madvise(
                                ptr,
                                w.len,
                                libc::MADV_REMOVE,
                                "madvise(MADV_REMOVE)",
                                gpa_range,
                            )?;
                        } else {
                            return Err(DiscardError::Syscall {
                                op: "fallocate(PUNCH_HOLE)",
                                gpa: gpa_range.gpa,
                                len: gpa_range.len,
                                source: e,
                            });
                        }
                    }
                    if region.flags() & libc::MAP_PRIVATE != 0 {
                        madvise(
                            ptr,
                            w.len,
                            libc::MADV_DONTNEED,
                            "madvise(MADV_DONTNEED)",
                            gpa_range,
                        )?;
                    }
                }
                None => {
                    let (adv, op) = if region.flags() & libc::MAP_SHARED != 0 {
                        (libc::MADV_REMOVE, "madvise(MADV_REMOVE)")
                    } else {
                        (libc::MADV_DONTNEED, "madvise(MADV_DONTNEED)")
                    };
                    madvise(ptr, w.len, adv, op, gpa_range)?;
                }
            }
            out.discarded = w.len;
        }
        for p in partial {
            let g = GuestRange::new(rstart + (p.gpa - base), p.len);
            if zero_fill_partial {
                zero_fill(mem, g)?;
                out.zero_filled += p.len;
            } else {
                out.skipped += p.len;
            }
        }
        Ok(out)
    }
}

/// Test double: records every call and zero-fills the range through guest
/// memory (so it honours the zero guarantee without any system call).
#[derive(Debug, Default)]
pub struct RecordingDiscarder {
    /// Ranges passed to `discard`, in order.
    pub calls: Mutex<Vec<(GuestRange, bool)>>,
}

impl Discarder for RecordingDiscarder {
    fn leaves_zeroes(&self) -> bool {
        true
    }

    fn discard(
        &self,
        mem: &GuestMemoryMmap,
        range: GuestRange,
        zero_fill_partial: bool,
    ) -> Result<DiscardOutcome, DiscardError> {
        if let Ok(mut c) = self.calls.lock() {
            c.push((range, zero_fill_partial));
        }
        zero_fill(mem, range)?;
        Ok(DiscardOutcome {
            discarded: range.len,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::fs::File;
    use std::os::fd::FromRawFd;
    use vm_memory::{FileOffset, GuestRegionMmap, MmapRegion};

    fn memfd(size: u64) -> File {
        let name = CString::new("discard-test").unwrap();
        // SAFETY: valid C string; we take ownership of the returned fd.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fd was just created and is owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        f
    }

    fn blocks(f: &File) -> u64 {
        use std::os::unix::fs::MetadataExt;
        f.metadata().unwrap().blocks()
    }

    #[test]
    fn punch_hole_on_memfd() {
        let size = 1 << 20;
        let f = memfd(size);
        let fcheck = f.try_clone().unwrap();
        let region = MmapRegion::from_file(FileOffset::new(f, 0), size as usize).unwrap();
        let mem = GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(
            region,
            GuestAddress(0x10_0000),
        )
        .unwrap()])
        .unwrap();
        mem.write_slice(&vec![0x5a; size as usize], GuestAddress(0x10_0000))
            .unwrap();
        let before = blocks(&fcheck);
        let out = HostDiscarder
            .discard(&mem, GuestRange::new(0x10_0000 + 8192, 64 * 1024), false)
            .unwrap();
        assert_eq!(out.discarded, 64 * 1024);
        assert!(blocks(&fcheck) < before);
        let mut buf = vec![1u8; 64 * 1024 + 8192];
        mem.read_slice(&mut buf, GuestAddress(0x10_0000 + 4096))
            .unwrap();
        assert!(
            buf[..4096].iter().all(|&b| b == 0x5a),
            "neighbour below kept"
        );
        assert!(buf[4096..4096 + 64 * 1024].iter().all(|&b| b == 0));
        assert!(
            buf[4096 + 64 * 1024..].iter().all(|&b| b == 0x5a),
            "neighbour above kept"
        );
    }

    #[test]
    fn dontneed_on_private_anon() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        mem.write_slice(&[7u8; 8192], GuestAddress(4096)).unwrap();
        let out = HostDiscarder
            .discard(&mem, GuestRange::new(4096, 4096), false)
            .unwrap();
        assert_eq!(out.discarded, 4096);
        let mut b = [1u8; 8192];
        mem.read_slice(&mut b, GuestAddress(4096)).unwrap();
        assert!(b[..4096].iter().all(|&x| x == 0));
        assert!(b[4096..].iter().all(|&x| x == 7));
    }

    #[test]
    fn outside_region_is_error() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        assert!(HostDiscarder
            .discard(&mem, GuestRange::new(1 << 16, 4096), false)
            .is_err());
        assert!(HostDiscarder
            .discard(&mem, GuestRange::new(0, 1 << 17), false)
            .is_err());
    }

    #[test]
    fn noop_and_recording() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).unwrap();
        let o = NoopDiscarder
            .discard(&mem, GuestRange::new(0, 4096), true)
            .unwrap();
        assert_eq!(o.skipped, 4096);
        assert!(!NoopDiscarder.leaves_zeroes());
        let r = RecordingDiscarder::default();
        mem.write_slice(&[3u8; 4096], GuestAddress(0)).unwrap();
        r.discard(&mem, GuestRange::new(0, 4096), false).unwrap();
        assert_eq!(r.calls.lock().unwrap().len(), 1);
        let mut b = [1u8; 4096];
        mem.read_slice(&mut b, GuestAddress(0)).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }
}
