//! virtio-balloon device backend over vhost-user (see README.md).
#![deny(missing_docs)]

pub mod backend;
pub mod chain;
pub mod cli;
pub mod control;
pub mod discard;
pub mod memfile;
pub mod metrics;
pub mod pool;
pub mod ranges;
pub mod server;
pub mod shim;
pub mod spec;
