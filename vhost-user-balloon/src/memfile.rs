//! What a frontend may share as guest memory (SET_MEM_TABLE) or as a dirty
//! log (SET_LOG_BASE): a regular file that holds every byte of the mapping,
//! and that the frontend cannot shrink under it when it is a memfd.
//!
//! A shared mapping of a file faults with SIGBUS where it lies past the end
//! of the file; SIGBUS ends the whole daemon, and with it the service for
//! every later frontend. So, before the library maps anything:
//!
//! * the fd must be a regular file (memfd, tmpfs, hugetlbfs or any other
//!   file; not a pipe, socket, device or directory), and
//!   `offset + size <= st_size`;
//! * a memfd must carry `F_SEAL_SHRINK`, so that it cannot be truncated
//!   while the daemon maps it. QEMU's `memory-backend-memfd` seals its memfd
//!   that way by default (`seal=on`: `F_SEAL_GROW | F_SEAL_SHRINK |
//!   F_SEAL_SEAL`), and so does its vhost dirty log.
//!
//! A regular file that is not a memfd (User-Mode Linux shares its RAM as an
//! unlinked temporary file) cannot be sealed; for it the end-of-file check
//! is all that is done, and the frontend is trusted not to truncate it while
//! it is connected (see README.md, "Trust").

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use thiserror::Error;

/// Error of this module: why a shared file is refused.
#[derive(Debug, Error)]
pub enum MemFileError {
    /// fstat (or duplicating the fd for it) failed.
    #[error("cannot stat the file: {0}")]
    Stat(io::Error),
    /// Not a regular file.
    #[error("not a regular file")]
    NotRegular,
    /// `offset + size` overflows.
    #[error("offset {offset:#x} + size {size:#x} overflows")]
    Overflow {
        /// mmap offset
        offset: u64,
        /// mapping size
        size: u64,
    },
    /// The mapping would reach past the end of the file.
    #[error(
        "offset {offset:#x} + size {size:#x} is past the end of the file ({file_size:#x} bytes)"
    )]
    PastEnd {
        /// mmap offset
        offset: u64,
        /// mapping size
        size: u64,
        /// st_size
        file_size: u64,
    },
    /// A memfd that is not sealed against shrinking.
    #[error("memfd not sealed against shrinking (F_SEAL_SHRINK): it could be truncated under the mapping")]
    Unsealed,
    /// F_GET_SEALS failed on a memfd.
    #[error("cannot read the seals of the memfd: {0}")]
    Seals(io::Error),
}

/// What kind of file passed the check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedFile {
    /// A memfd sealed against shrinking.
    SealedMemfd,
    /// Another regular file (checked against its current size only).
    RegularFile,
}

/// Whether `fd` is a memfd: its `/proc/self/fd` link reads `/memfd:NAME
/// (deleted)`. Without /proc the answer is "no", and only the end-of-file
/// check applies.
fn is_memfd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|p| p.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"))
}

fn seals(fd: BorrowedFd<'_>) -> Result<libc::c_int, MemFileError> {
    // SAFETY: F_GET_SEALS on a valid fd only returns a value.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if rc < 0 {
        return Err(MemFileError::Seals(io::Error::last_os_error()));
    }
    Ok(rc)
}

/// Checks that `size` bytes from `offset` of the file behind `fd` can be
/// mapped shared without a SIGBUS now or later (see the module
/// documentation).
pub fn check_shared_file(
    fd: BorrowedFd<'_>,
    offset: u64,
    size: u64,
) -> Result<SharedFile, MemFileError> {
    let meta = File::from(fd.try_clone_to_owned().map_err(MemFileError::Stat)?)
        .metadata()
        .map_err(MemFileError::Stat)?;
    if !meta.file_type().is_file() {
        return Err(MemFileError::NotRegular);
    }
    let end = offset
        .checked_add(size)
        .ok_or(MemFileError::Overflow { offset, size })?;
    if end > meta.len() {
        return Err(MemFileError::PastEnd {
            offset,
            size,
            file_size: meta.len(),
        });
    }
    if !is_memfd(fd) {
        return Ok(SharedFile::RegularFile);
    }
    if seals(fd)? & libc::F_SEAL_SHRINK == 0 {
        return Err(MemFileError::Unsealed);
    }
    Ok(SharedFile::SealedMemfd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::fd::{AsFd, FromRawFd};

    fn memfd(size: u64, seals: libc::c_int) -> File {
        let name = CString::new("memfile-test").unwrap();
        // SAFETY: valid C string; we own the returned fd.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        assert!(fd >= 0);
        // SAFETY: fresh fd owned by nobody else.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(size).unwrap();
        if seals != 0 {
            // SAFETY: fcntl on a valid fd.
            assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) }, 0);
        }
        f
    }

    fn check(f: &impl AsFd, offset: u64, size: u64) -> Result<SharedFile, String> {
        check_shared_file(f.as_fd(), offset, size).map_err(|e| e.to_string())
    }

    #[test]
    fn sealed_memfd_inside_its_size() {
        let f = memfd(1 << 20, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        assert_eq!(check(&f, 0, 1 << 20), Ok(SharedFile::SealedMemfd));
        assert_eq!(
            check(&f, 4096, (1 << 20) - 4096),
            Ok(SharedFile::SealedMemfd)
        );
        assert_eq!(check(&f, 0, 0), Ok(SharedFile::SealedMemfd));
    }

    #[test]
    fn past_the_end_or_overflowing_is_refused() {
        let f = memfd(1 << 20, libc::F_SEAL_SHRINK);
        assert!(check(&f, 0, 1 << 40).unwrap_err().contains("past the end"));
        assert!(check(&f, 4096, 1 << 20)
            .unwrap_err()
            .contains("past the end"));
        assert!(check(&f, u64::MAX, 2).unwrap_err().contains("overflows"));
    }

    #[test]
    fn memfd_that_can_shrink_is_refused() {
        // no seals at all, and sealed against growing only
        assert!(check(&memfd(4096, 0), 0, 4096)
            .unwrap_err()
            .contains("F_SEAL_SHRINK"));
        let grow = memfd(4096, libc::F_SEAL_GROW);
        assert!(check(&grow, 0, 4096).unwrap_err().contains("F_SEAL_SHRINK"));
    }

    #[test]
    fn regular_file_needs_no_seal_but_must_be_long_enough() {
        let dir = std::env::temp_dir();
        let f = tempfile_in(&dir);
        f.set_len(8192 + 1).unwrap();
        assert_eq!(check(&f, 4096, 4096), Ok(SharedFile::RegularFile));
        assert!(check(&f, 4096, 8192).unwrap_err().contains("past the end"));
    }

    #[test]
    fn not_a_regular_file_is_refused() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(check(&a, 0, 0), Err("not a regular file".into()));
        let dir = File::open(std::env::temp_dir()).unwrap();
        assert_eq!(check(&dir, 0, 0), Err("not a regular file".into()));
        let null = File::open("/dev/null").unwrap();
        assert_eq!(check(&null, 0, 4096), Err("not a regular file".into()));
    }

    fn tempfile_in(dir: &std::path::Path) -> File {
        let p = dir.join(format!("vub-memfile-{}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&p)
            .unwrap();
        std::fs::remove_file(&p).unwrap();
        f
    }
}
