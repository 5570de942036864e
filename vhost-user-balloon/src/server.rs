//! Daemon main loop: listen, serve one frontend at a time, loop; clean
//! shutdown on SIGTERM/SIGINT.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;

use log::{error, info, warn};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::os::fd::AsRawFd;
use thiserror::Error;
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;
use vmm_sys_util::epoll::EventSet;

use crate::backend::{BalloonBackend, DeviceState, STATS_REQUEST_EVENT};
use crate::cli::{Config, DiscardMode};
use crate::control::{self, ControlError};
use crate::discard::{DelayedDiscarder, Discarder, GuestMem, HostDiscarder, NoopDiscarder};
use crate::shim::{Hooks, Shim, ShimError};

/// Error of this module.
#[derive(Debug, Error)]
pub enum ServerError {
    /// Binding the vhost-user socket failed.
    #[error("cannot bind {path}: {source}")]
    Bind {
        /// socket path
        path: PathBuf,
        /// cause
        source: io::Error,
    },
    /// Accepting a frontend failed.
    #[error("accept failed: {0}")]
    Accept(io::Error),
    /// Internal socket between shim and library.
    #[error("internal socket: {0}")]
    Internal(io::Error),
    /// vhost-user-backend error.
    #[error("vhost-user daemon: {0}")]
    Daemon(String),
    /// Control socket.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// Connection shim.
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// Shared state creation.
    #[error("cannot create device state: {0}")]
    State(io::Error),
    /// Signal handler installation.
    #[error("cannot install signal handlers: {0}")]
    Signals(io::Error),
    /// Registering the stats request eventfd.
    #[error("cannot register stats event: {0}")]
    Register(io::Error),
    /// Something other than a socket is at a socket path.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// A stale socket could not be inspected or removed.
    #[error("cannot replace {path}: {source}")]
    Stale {
        /// socket path
        path: PathBuf,
        /// cause
        source: io::Error,
    },
}

/// Makes `path` free for a new socket: a stale socket there is removed,
/// anything else (a regular file, a directory, a symlink, ...) is an error
/// and stays. The command line checks this too, but a file can appear
/// between that check and the bind.
fn claim_socket_path(path: &Path) -> Result<(), ServerError> {
    let stale = |source| ServerError::Stale {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match std::fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(stale(e)),
            _ => Ok(()),
        },
        Ok(_) => Err(ServerError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(stale(e)),
    }
}

/// Bytes of a UNIX socket path, the terminating NUL excluded.
const SUN_PATH_MAX: usize = 107;

/// A listening socket that appears at `path` only once it accepts: it is
/// bound (and listens) under a temporary name in the same directory, then
/// hard-linked to `path` and the temporary name removed. A supervisor that
/// waits for the file therefore never meets a socket that refuses
/// connections. The link fails if something appeared at `path` since
/// `claim_socket_path`: what is there stays.
fn listen_at(path: &Path) -> io::Result<UnixListener> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = dir.join(format!(".{}", std::process::id()));
    if tmp.as_os_str().len() > SUN_PATH_MAX {
        // no room for the temporary name: bind in place (the socket then
        // exists a moment before it accepts)
        return UnixListener::bind(path);
    }
    // a socket of an earlier process with this pid (killed between its bind
    // and its link) is stale; anything else there is an error
    if let Ok(m) = std::fs::symlink_metadata(&tmp) {
        if !m.file_type().is_socket() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", tmp.display()),
            ));
        }
        std::fs::remove_file(&tmp)?;
    }
    let listener = UnixListener::bind(&tmp)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    linked.map(|()| listener)
}

/// Removes the socket files in `published` (those this process created so
/// far) on SIGTERM/SIGINT and exits with status 0. Installed before the first
/// socket appears.
fn install_signal_handler(published: Arc<Mutex<Vec<PathBuf>>>) -> Result<(), ServerError> {
    let mut signals = Signals::new([SIGTERM, SIGINT]).map_err(ServerError::Signals)?;
    thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                info!("signal {sig}: shutting down");
                let paths = published.lock().unwrap_or_else(|e| e.into_inner());
                for p in paths.iter() {
                    let _ = std::fs::remove_file(p);
                }
                std::process::exit(0);
            }
        })
        .map_err(ServerError::Signals)?;
    Ok(())
}

/// Serves one accepted frontend until it disconnects.
fn serve_connection(
    front: UnixStream,
    conn_no: u64,
    config: &Config,
    state: &Arc<DeviceState>,
    discarder: &Arc<dyn Discarder>,
) -> Result<(), ServerError> {
    let backend = BalloonBackend::with_discard_threads(
        state.clone(),
        discarder.clone(),
        config.features,
        config.discard_threads,
    )
    .map_err(|e| ServerError::Daemon(e.to_string()))?;
    let mem = GuestMemoryAtomic::new(GuestMem::new());
    let mut daemon = VhostUserDaemon::new("vhost-user-balloon".into(), backend.clone(), mem)
        .map_err(|e| ServerError::Daemon(e.to_string()))?;

    // The library accepts on an (abstract, private) listener; the shim
    // connects to it and relays the frontend's messages.
    let name = format!("vhost-user-balloon.{}.{conn_no}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(ServerError::Internal)?;
    let inner = UnixListener::bind_addr(&addr).map_err(ServerError::Internal)?;
    let back = UnixStream::connect_addr(&addr).map_err(ServerError::Internal)?;
    let (st1, st2, st3) = (state.clone(), state.clone(), state.clone());
    let hooks = Hooks {
        on_protocol_features: Box::new(move |f| st1.set_acked_protocol_features(f)),
        on_backend_channel: Box::new(move |c| st2.set_backend_channel(c)),
        on_migrated_config: Box::new(move |o, b| st3.restore_migrated_config(o, b)),
    };
    let shim = Shim::spawn(front, back, hooks)?;
    let mut listener = Listener::from(inner);
    daemon
        .start(&mut listener)
        .map_err(|e| ServerError::Daemon(e.to_string()))?;
    for h in daemon.get_epoll_handlers() {
        h.register_listener(
            state.stats_request_fd().as_raw_fd(),
            EventSet::IN,
            u64::from(STATS_REQUEST_EVENT),
        )
        .map_err(ServerError::Register)?;
    }
    let res = daemon.wait();
    // Every discard of this frontend is done before the next one connects
    // (it may share the same memory and reuse the reported pages).
    backend.quiesce();
    state.connection_closed();
    shim.join();
    match res {
        Ok(())
        | Err(vhost_user_backend::Error::HandleRequest(
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage,
        )) => info!("frontend disconnected"),
        Err(e) => warn!("frontend connection ended: {e}"),
    }
    Ok(())
}

/// Runs the daemon until a signal arrives.
pub fn run(config: Config) -> Result<(), ServerError> {
    claim_socket_path(&config.socket_path)?;
    if let Some(c) = &config.control_socket {
        claim_socket_path(c)?;
    }
    let state = Arc::new(DeviceState::new(config.initial_target).map_err(ServerError::State)?);
    let discarder: Arc<dyn Discarder> = match config.discard {
        DiscardMode::Auto => Arc::new(HostDiscarder),
        DiscardMode::None => Arc::new(NoopDiscarder),
    };
    let discarder: Arc<dyn Discarder> = if config.discard_delay.is_zero() {
        discarder
    } else {
        warn!(
            "every discard waits {} ms (--discard-delay-ms, for tests)",
            config.discard_delay.as_millis()
        );
        Arc::new(DelayedDiscarder::new(discarder, config.discard_delay))
    };
    // The control socket first: once the vhost-user socket exists, both
    // accept (see `listen_at`).
    let published = Arc::new(Mutex::new(Vec::new()));
    install_signal_handler(published.clone())?;
    if let Some(c) = &config.control_socket {
        let l = listen_at(c).map_err(|source| ControlError::Bind {
            path: c.clone(),
            source,
        })?;
        published
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(c.clone());
        control::spawn(l, state.clone())?;
    }
    let listener = listen_at(&config.socket_path).map_err(|source| ServerError::Bind {
        path: config.socket_path.clone(),
        source,
    })?;
    published
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(config.socket_path.clone());
    info!(
        "listening on {} (virtio-balloon, offered features {:#x}, {} discard thread(s))",
        config.socket_path.display(),
        config.features.virtio_features(discarder.releases_memory()),
        config.discard_threads
    );
    let mut conn_no = 0u64;
    loop {
        let (front, _) = listener.accept().map_err(ServerError::Accept)?;
        conn_no += 1;
        info!("frontend connected (connection {conn_no})");
        if let Err(e) = serve_connection(front, conn_no, &config, &state, &discarder) {
            error!("connection {conn_no}: {e}");
            state.connection_closed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Args;
    use clap::Parser;
    use std::sync::mpsc;
    use std::time::Duration;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vub-server-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A config for `argv`, validated while its paths do not exist yet (as
    /// for a file that appears after the daemon checked its arguments).
    fn config(argv: &[&str]) -> Config {
        let mut all = vec!["vhost-user-balloon"];
        all.extend_from_slice(argv);
        Config::try_from(Args::try_parse_from(all).unwrap()).unwrap()
    }

    /// The socket and control paths in `d`, and a config for both.
    fn with_control(d: &Path) -> (PathBuf, PathBuf, Config) {
        let (sock, ctl) = (d.join("balloon.sock"), d.join("balloon.ctl"));
        let c = config(&[
            "-s",
            sock.to_str().unwrap(),
            "--control-socket",
            ctl.to_str().unwrap(),
        ]);
        (sock, ctl, c)
    }

    /// Runs the daemon in a thread; its error if it ends within a second.
    fn run_briefly(config: Config) -> Option<String> {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(run(config).map_err(|e| e.to_string()));
        });
        rx.recv_timeout(Duration::from_secs(1))
            .ok()
            .map(|r| r.err().unwrap_or_default())
    }

    /// A supervisor (systemd, libvirt, the lab) starts the frontend as soon
    /// as the vhost-user socket exists: by then both sockets must accept.
    #[test]
    fn both_sockets_accept_once_the_vhost_user_socket_exists() {
        for round in 0..20 {
            let (sock, ctl, c) = with_control(&dir(&format!("ready{round}")));
            thread::spawn(move || run(c));
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while std::fs::symlink_metadata(&sock).is_err() {
                assert!(std::time::Instant::now() < deadline, "no socket");
                std::hint::spin_loop();
            }
            if let Err(e) = UnixStream::connect(&ctl) {
                panic!("round {round}: control socket: {e}");
            }
            if let Err(e) = UnixStream::connect(&sock) {
                panic!("round {round}: vhost-user socket: {e}");
            }
        }
    }

    #[test]
    fn a_regular_file_at_the_socket_path_is_never_deleted() {
        let d = dir("regular");
        let sock = d.join("balloon.sock");
        let c = config(&["-s", sock.to_str().unwrap()]);
        std::fs::write(&sock, b"keep me").unwrap();
        let res = run_briefly(c);
        assert_eq!(
            std::fs::read(&sock).map_err(|e| e.to_string()),
            Ok(b"keep me".to_vec()),
            "the regular file at --socket-path"
        );
        assert!(
            res.as_deref().is_some_and(|e| e.contains("not a socket")),
            "{res:?}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_regular_file_or_symlink_at_the_control_path_is_never_deleted() {
        let d = dir("control");
        let (sock, ctl, c) = with_control(&d);
        std::fs::write(&ctl, b"keep me").unwrap();
        let res = run_briefly(c.clone());
        assert_eq!(std::fs::read(&ctl).ok(), Some(b"keep me".to_vec()));
        assert!(
            res.as_deref().is_some_and(|e| e.contains("not a socket")),
            "{res:?}"
        );
        // a symlink (to a file that must stay too) is not a socket either
        let target = d.join("target");
        std::fs::rename(&ctl, &target).unwrap();
        std::os::unix::fs::symlink(&target, &ctl).unwrap();
        let _ = std::fs::remove_file(&sock);
        let res = run_briefly(c);
        assert!(std::fs::symlink_metadata(&ctl).is_ok_and(|m| m.file_type().is_symlink()));
        assert_eq!(std::fs::read(&target).ok(), Some(b"keep me".to_vec()));
        assert!(
            res.as_deref().is_some_and(|e| e.contains("not a socket")),
            "{res:?}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
