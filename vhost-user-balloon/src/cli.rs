//! Command line: clap `Args` -> validated `Config`.

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use thiserror::Error;

use crate::backend::DeviceFeatures;
use crate::pool::{default_threads, MAX_DISCARD_THREADS};

/// How inflated / reported pages are given back to the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DiscardMode {
    /// Punch holes in the shared memory file (fallocate PUNCH_HOLE|KEEP_SIZE;
    /// falls back to madvise(MADV_REMOVE)); huge-page aligned on hugetlbfs.
    Auto,
    /// Never discard (pages stay populated and untouched); the proposed
    /// feature bits 6/7 are not offered.
    None,
}

/// Log verbosity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogLevel {
    /// Errors only.
    Error,
    /// Warnings and errors (rejected guest ranges are warnings).
    Warn,
    /// Connection and negotiation events.
    Info,
    /// Every request.
    Debug,
    /// Everything, including library internals.
    Trace,
}

impl LogLevel {
    /// As a `log` filter.
    pub fn filter(self) -> log::LevelFilter {
        match self {
            LogLevel::Error => log::LevelFilter::Error,
            LogLevel::Warn => log::LevelFilter::Warn,
            LogLevel::Info => log::LevelFilter::Info,
            LogLevel::Debug => log::LevelFilter::Debug,
            LogLevel::Trace => log::LevelFilter::Trace,
        }
    }
}

/// virtio-balloon device backend over vhost-user (virtio device id 5).
///
/// Listens on a vhost-user socket; a frontend (QEMU, User-Mode Linux
/// `virtio_uml.device=<socket>:5`, ...) connects and shares guest memory.
/// After a frontend disconnects the daemon waits for the next one.
#[derive(Parser, Debug, Clone, PartialEq, Eq)]
#[command(name = "vhost-user-balloon", version, about, long_about)]
pub struct Args {
    /// Path of the vhost-user UNIX socket to create and listen on.
    #[arg(long, short = 's', value_name = "PATH")]
    pub socket_path: PathBuf,

    /// Path of the JSON-lines control socket (set_target, get_stats,
    /// get_counters, get_config). No control socket if omitted.
    #[arg(long, value_name = "PATH")]
    pub control_socket: Option<PathBuf>,

    /// Initial balloon target (`num_pages`) in 4 KiB pages.
    #[arg(long, value_name = "PAGES", default_value_t = 0)]
    pub initial_target: u32,

    /// Do not offer VIRTIO_BALLOON_F_STATS_VQ (no statistics queue).
    #[arg(long)]
    pub no_stats: bool,

    /// Do not offer VIRTIO_BALLOON_F_REPORTING (no free page reporting queue).
    #[arg(long)]
    pub no_reporting: bool,

    /// Do not offer VIRTIO_BALLOON_F_DEFLATE_ON_OOM.
    #[arg(long)]
    pub no_deflate_on_oom: bool,

    /// Do not offer VIRTIO_BALLOON_F_MUST_TELL_HOST.
    #[arg(long)]
    pub no_must_tell_host: bool,

    /// Do not offer VIRTIO_BALLOON_F_PAGE_POISON (note: Linux then disables
    /// free page reporting when it poisons or zeroes freed pages).
    #[arg(long)]
    pub no_page_poison: bool,

    /// Experimental: offer VIRTIO_BALLOON_F_DEVICE_INIT_REPORTED (bit 6):
    /// reported pages are discarded or written, and the used length says
    /// so. The bit number follows an in-flight virtio spec proposal and may
    /// change; a frontend that migrates needs the same setting on both
    /// sides. Needs free page reporting and a discard mode that releases
    /// memory.
    #[arg(long)]
    pub x_device_init_reported: bool,

    /// Experimental: offer VIRTIO_BALLOON_F_DEVICE_INIT_ON_INFLATE (bit 7):
    /// the device tells the driver, in a bitmap after each inflate chain,
    /// which inflated pages read as zero. The bit number follows an
    /// in-flight virtio spec proposal and may change; a frontend that
    /// migrates needs the same setting on both sides.
    #[arg(long)]
    pub x_device_init_on_inflate: bool,

    /// Do not offer VHOST_USER_PROTOCOL_F_BACKEND_REQ; the guest then only
    /// learns a new target when it re-reads the config space itself.
    #[arg(long)]
    pub no_backend_req: bool,

    /// Do not offer VHOST_F_LOG_ALL and VHOST_USER_PROTOCOL_F_LOG_SHMFD
    /// (dirty logging). A frontend then cannot migrate a VM with this device
    /// (QEMU registers a migration blocker).
    #[arg(long)]
    pub no_dirty_log: bool,

    /// How pages are given back to the host.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = DiscardMode::Auto)]
    pub discard: DiscardMode,

    /// Threads that discard reported free pages, off the thread that serves
    /// the virtqueues; the ranges of one report are discarded in parallel
    /// and the report is acknowledged when all of them are done. 0 discards
    /// on the virtqueue thread itself (inflate, deflate and stats then wait
    /// for every report). Default: 2, or 1 on a single CPU.
    #[arg(long, value_name = "N", default_value_t = default_threads())]
    pub discard_threads: usize,

    /// Testing: wait this long before every discard, as a host that is slow
    /// to give memory back would. Reports then stay in flight long enough to
    /// test what a guest does meanwhile (e.g. power off).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub discard_delay_ms: u64,

    /// Log level (logs go to stderr; RUST_LOG is not consulted).
    #[arg(long, value_enum, value_name = "LEVEL", default_value_t = LogLevel::Info)]
    pub log_level: LogLevel,
}

/// Error of this module.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CliError {
    /// Empty path.
    #[error("{0} must not be empty")]
    EmptyPath(&'static str),
    /// Both sockets at the same path.
    #[error("--control-socket must differ from --socket-path")]
    SamePath,
    /// Directory of a socket does not exist.
    #[error("directory of {0} does not exist")]
    NoParent(PathBuf),
    /// Path exists and is not a socket (we would delete it).
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// More discard threads than allowed.
    #[error("--discard-threads {0}: at most {MAX_DISCARD_THREADS}")]
    TooManyThreads(usize),
    /// Discard delay out of range.
    #[error("--discard-delay-ms {0}: at most {MAX_DISCARD_DELAY_MS}")]
    DelayTooLong(u64),
}

/// Longest `--discard-delay-ms`: 10 minutes.
pub const MAX_DISCARD_DELAY_MS: u64 = 600_000;

/// Validated configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// vhost-user socket.
    pub socket_path: PathBuf,
    /// control socket.
    pub control_socket: Option<PathBuf>,
    /// initial `num_pages`.
    pub initial_target: u32,
    /// features offered.
    pub features: DeviceFeatures,
    /// discard method.
    pub discard: DiscardMode,
    /// discard worker threads (0: on the vring thread).
    pub discard_threads: usize,
    /// wait before every discard (testing).
    pub discard_delay: std::time::Duration,
    /// log level.
    pub log_level: LogLevel,
}

fn check_path(p: &std::path::Path, what: &'static str) -> Result<(), CliError> {
    use std::os::unix::fs::FileTypeExt;
    if p.as_os_str().is_empty() {
        return Err(CliError::EmptyPath(what));
    }
    let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = parent {
        if !d.is_dir() {
            return Err(CliError::NoParent(p.to_path_buf()));
        }
    }
    if let Ok(m) = std::fs::symlink_metadata(p) {
        if !m.file_type().is_socket() {
            return Err(CliError::NotASocket(p.to_path_buf()));
        }
    }
    Ok(())
}

impl TryFrom<Args> for Config {
    type Error = CliError;

    fn try_from(a: Args) -> Result<Self, CliError> {
        check_path(&a.socket_path, "--socket-path")?;
        if let Some(c) = &a.control_socket {
            check_path(c, "--control-socket")?;
            if *c == a.socket_path {
                return Err(CliError::SamePath);
            }
        }
        if a.discard_threads > MAX_DISCARD_THREADS {
            return Err(CliError::TooManyThreads(a.discard_threads));
        }
        if a.discard_delay_ms > MAX_DISCARD_DELAY_MS {
            return Err(CliError::DelayTooLong(a.discard_delay_ms));
        }
        Ok(Config {
            socket_path: a.socket_path,
            control_socket: a.control_socket,
            initial_target: a.initial_target,
            features: DeviceFeatures {
                must_tell_host: !a.no_must_tell_host,
                stats: !a.no_stats,
                deflate_on_oom: !a.no_deflate_on_oom,
                page_poison: !a.no_page_poison,
                reporting: !a.no_reporting,
                init_reported: a.x_device_init_reported && a.discard != DiscardMode::None,
                init_on_inflate: a.x_device_init_on_inflate && a.discard != DiscardMode::None,
                backend_req: !a.no_backend_req,
                dirty_log: !a.no_dirty_log,
            },
            discard: a.discard,
            discard_threads: a.discard_threads,
            discard_delay: std::time::Duration::from_millis(a.discard_delay_ms),
            log_level: a.log_level,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: &[&str]) -> Result<Config, CliError> {
        let mut all = vec!["vhost-user-balloon"];
        all.extend_from_slice(v);
        Config::try_from(Args::try_parse_from(all).unwrap())
    }

    #[test]
    fn defaults() {
        let c = parse(&["--socket-path", "/tmp/x.sock"]).unwrap();
        assert_eq!(c.features, DeviceFeatures::default());
        assert_eq!(c.discard, DiscardMode::Auto);
        assert_eq!(c.control_socket, None);
        assert_eq!(c.discard_threads, default_threads());
        let c = parse(&["-s", "/tmp/x.sock", "--discard-threads", "0"]).unwrap();
        assert_eq!(c.discard_threads, 0);
        assert_eq!(
            parse(&["-s", "/tmp/x.sock", "--discard-threads", "65"]),
            Err(CliError::TooManyThreads(65))
        );
        assert!(c.discard_delay.is_zero());
        let c = parse(&["-s", "/tmp/x.sock", "--discard-delay-ms", "600000"]).unwrap();
        assert_eq!(c.discard_delay, std::time::Duration::from_secs(600));
        assert_eq!(
            parse(&["-s", "/tmp/x.sock", "--discard-delay-ms", "600001"]),
            Err(CliError::DelayTooLong(600_001))
        );
    }

    #[test]
    fn flags() {
        let c = parse(&[
            "-s",
            "/tmp/x.sock",
            "--no-stats",
            "--no-reporting",
            "--no-dirty-log",
            "--discard",
            "none",
            "--x-device-init-reported",
            "--x-device-init-on-inflate",
        ])
        .unwrap();
        assert!(!c.features.dirty_log);
        assert!(!c.features.stats);
        assert!(!c.features.reporting);
        assert!(
            !c.features.init_reported && !c.features.init_on_inflate,
            "discard none implies no init bits"
        );
        let c = parse(&["-s", "/tmp/x.sock", "--initial-target", "7"]).unwrap();
        assert!(!c.features.init_reported && !c.features.init_on_inflate);
        assert_eq!(c.initial_target, 7);
        let c = parse(&["-s", "/tmp/x.sock", "--x-device-init-reported"]).unwrap();
        assert!(c.features.init_reported && !c.features.init_on_inflate);
        let c = parse(&["-s", "/tmp/x.sock", "--x-device-init-on-inflate"]).unwrap();
        assert!(!c.features.init_reported && c.features.init_on_inflate);
    }

    #[test]
    fn invalid() {
        // clap already refuses an empty path; the check also guards direct use.
        assert!(Args::try_parse_from(["x", "-s", ""]).is_err());
        let mut a = Args::try_parse_from(["x", "-s", "/tmp/a.sock"]).unwrap();
        a.socket_path = PathBuf::new();
        assert_eq!(
            Config::try_from(a),
            Err(CliError::EmptyPath("--socket-path"))
        );
        assert_eq!(
            parse(&["-s", "/tmp/a.sock", "--control-socket", "/tmp/a.sock"]),
            Err(CliError::SamePath)
        );
        assert!(matches!(
            parse(&["-s", "/nonexistent-dir/a.sock"]),
            Err(CliError::NoParent(_))
        ));
        assert!(matches!(
            parse(&["-s", "/etc/hostname"]),
            Err(CliError::NotASocket(_))
        ));
        assert!(Args::try_parse_from(["x"]).is_err());
    }
}
