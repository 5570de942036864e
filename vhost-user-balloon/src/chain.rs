//! Descriptor chains of a split virtqueue as the device takes them: read
//! once from the descriptor table, then used from that copy.
//!
//! Reading the chain once means that a guest that rewrites its descriptors
//! while the device works sees the device act on one consistent view (the
//! bitmap room checked is the room written). What is refused:
//!
//! * a descriptor with `VIRTQ_DESC_F_INDIRECT`: the device does not offer
//!   `VIRTIO_RING_F_INDIRECT_DESC` (the `virtio-queue` iterator would follow
//!   such tables anyway);
//! * a next index past the end of the ring, a chain longer than the ring (a
//!   loop), descriptors whose lengths add up to more than 4 GiB (virtio 1.2
//!   2.7.5.2), a descriptor the device cannot read.
//!
//! A refused chain is malformed: the caller returns it with used length 0.
//! A head index past the end of the ring cannot even be returned.

use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use crate::discard::GuestMem;

/// `VIRTQ_DESC_F_NEXT`.
pub const DESC_F_NEXT: u16 = 1;
/// `VIRTQ_DESC_F_WRITE`: device-writable buffer.
pub const DESC_F_WRITE: u16 = 2;
/// `VIRTQ_DESC_F_INDIRECT`.
pub const DESC_F_INDIRECT: u16 = 4;
/// Size of one split-ring descriptor.
pub const DESC_SIZE: u64 = 16;

/// Error of this module: why a chain was refused.
#[derive(Debug, Error)]
pub enum ChainError {
    /// The avail ring named a head past the end of the ring.
    #[error("head {head} is past the end of the {size}-entry ring")]
    HeadOutOfRange {
        /// head index from the avail ring
        head: u16,
        /// ring size
        size: u16,
    },
    /// A descriptor's next index is past the end of the ring.
    #[error("descriptor {index} chains to {next}, past the end of the {size}-entry ring")]
    NextOutOfRange {
        /// descriptor index
        index: u16,
        /// its next field
        next: u16,
        /// ring size
        size: u16,
    },
    /// More descriptors than the ring has: the chain loops.
    #[error("chain from head {head} is longer than the {size}-entry ring (a loop)")]
    Loop {
        /// head index
        head: u16,
        /// ring size
        size: u16,
    },
    /// An indirect descriptor; VIRTIO_RING_F_INDIRECT_DESC is not offered.
    #[error("descriptor {0} is indirect (VIRTIO_RING_F_INDIRECT_DESC is not offered)")]
    Indirect(u16),
    /// The buffers add up to more than 4 GiB.
    #[error("chain from head {0} is longer than 4 GiB")]
    TooLong(u16),
    /// A descriptor could not be read from guest memory.
    #[error("descriptor {index} at {addr:#x} cannot be read: {source}")]
    Read {
        /// descriptor index
        index: u16,
        /// its guest address
        addr: u64,
        /// cause
        source: GuestMemoryError,
    },
}

/// One descriptor of a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Guest-physical address of the buffer.
    pub addr: u64,
    /// Length of the buffer.
    pub len: u32,
    /// Device-writable (`VIRTQ_DESC_F_WRITE`).
    pub writable: bool,
}

/// A descriptor chain, read once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// Index of the head descriptor (what goes into the used ring).
    pub head: u16,
    /// The descriptors, in chain order.
    pub descs: Vec<Desc>,
}

impl Chain {
    /// Reads the chain that starts at `head` from the descriptor table at
    /// guest address `table` of a ring of `size` entries.
    pub fn read(mem: &GuestMem, table: u64, size: u16, head: u16) -> Result<Self, ChainError> {
        if head >= size {
            return Err(ChainError::HeadOutOfRange { head, size });
        }
        let mut descs = Vec::new();
        let mut total = 0u32;
        let mut index = head;
        loop {
            if descs.len() >= usize::from(size) {
                return Err(ChainError::Loop { head, size });
            }
            let (desc, flags, next) = read_desc(mem, table, index)?;
            if flags & DESC_F_INDIRECT != 0 {
                return Err(ChainError::Indirect(index));
            }
            total = total
                .checked_add(desc.len)
                .ok_or(ChainError::TooLong(head))?;
            descs.push(desc);
            if flags & DESC_F_NEXT == 0 {
                return Ok(Self { head, descs });
            }
            if next >= size {
                return Err(ChainError::NextOutOfRange { index, next, size });
            }
            index = next;
        }
    }

    /// The device-readable descriptors, in order.
    pub fn readable(&self) -> impl Iterator<Item = &Desc> {
        self.descs.iter().filter(|d| !d.writable)
    }

    /// The device-writable descriptors, in order.
    pub fn writable(&self) -> impl Iterator<Item = &Desc> {
        self.descs.iter().filter(|d| d.writable)
    }

    /// Total length of the device-writable descriptors.
    pub fn writable_len(&self) -> u64 {
        self.writable().map(|d| u64::from(d.len)).sum()
    }
}

/// Reads descriptor `index`: the descriptor, its flags and next field.
fn read_desc(mem: &GuestMem, table: u64, index: u16) -> Result<(Desc, u16, u16), ChainError> {
    let addr = table.wrapping_add(u64::from(index) * DESC_SIZE);
    let mut b = [0u8; DESC_SIZE as usize];
    mem.read_slice(&mut b, GuestAddress(addr))
        .map_err(|source| ChainError::Read {
            index,
            addr,
            source,
        })?;
    let u64_at = |o: usize| {
        let mut v = [0u8; 8];
        v.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(v)
    };
    let flags = u16::from_le_bytes([b[12], b[13]]);
    Ok((
        Desc {
            addr: u64_at(0),
            len: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            writable: flags & DESC_F_WRITE != 0,
        },
        flags,
        u16::from_le_bytes([b[14], b[15]]),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestAddress;

    const TABLE: u64 = 0x1000;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    fn put(mem: &GuestMem, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let d = TABLE + u64::from(index) * DESC_SIZE;
        mem.write_obj(addr, GuestAddress(d)).unwrap();
        mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        mem.write_obj(flags, GuestAddress(d + 12)).unwrap();
        mem.write_obj(next, GuestAddress(d + 14)).unwrap();
    }

    #[test]
    fn reads_a_chain_in_order() {
        let m = mem();
        put(&m, 3, 0x10_000, 4, DESC_F_NEXT, 7);
        put(&m, 7, 0x20_000, 1, DESC_F_WRITE, 0);
        let c = Chain::read(&m, TABLE, 16, 3).unwrap();
        assert_eq!(c.head, 3);
        assert_eq!(
            c.descs,
            vec![
                Desc {
                    addr: 0x10_000,
                    len: 4,
                    writable: false
                },
                Desc {
                    addr: 0x20_000,
                    len: 1,
                    writable: true
                }
            ]
        );
        assert_eq!(c.readable().count(), 1);
        assert_eq!(c.writable_len(), 1);
    }

    #[test]
    fn refuses_what_the_device_does_not_take() {
        let m = mem();
        let err = |head| Chain::read(&m, TABLE, 16, head).unwrap_err().to_string();
        assert!(err(16).contains("past the end"), "{}", err(16));
        // a loop: 0 -> 1 -> 0
        put(&m, 0, 0, 4, DESC_F_NEXT, 1);
        put(&m, 1, 0, 4, DESC_F_NEXT, 0);
        assert!(err(0).contains("loop"));
        // to itself
        put(&m, 2, 0, 4, DESC_F_NEXT, 2);
        assert!(err(2).contains("loop"));
        // next past the end
        put(&m, 3, 0, 4, DESC_F_NEXT, 5000);
        assert!(err(3).contains("5000"));
        // indirect, first or later in the chain
        put(&m, 4, 0x3000, 16, DESC_F_INDIRECT, 0);
        assert!(err(4).contains("indirect"));
        put(&m, 5, 0, 4, DESC_F_NEXT, 4);
        assert!(err(5).contains("indirect"));
        // more than 4 GiB in total
        put(&m, 6, 0, u32::MAX, DESC_F_NEXT, 7);
        put(&m, 7, 0, 1, 0, 0);
        assert!(err(6).contains("4 GiB"));
        // the table itself outside guest memory
        assert!(Chain::read(&m, 1 << 40, 16, 0).is_err());
        assert!(Chain::read(&m, u64::MAX - 8, 16, 0).is_err());
    }

    #[test]
    fn a_chain_may_use_every_descriptor_of_the_ring() {
        let m = mem();
        for i in 0..16u16 {
            let flags = if i < 15 { DESC_F_NEXT } else { 0 };
            put(&m, i, 0, 4, flags, i + 1);
        }
        assert_eq!(Chain::read(&m, TABLE, 16, 0).unwrap().descs.len(), 16);
    }
}
