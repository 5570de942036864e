//! Daemon main loop: listen, serve one frontend at a time, loop; clean
//! shutdown on SIGTERM/SIGINT.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
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
}

fn install_signal_handler(paths: Vec<PathBuf>) -> Result<(), ServerError> {
    let mut signals = Signals::new([SIGTERM, SIGINT]).map_err(ServerError::Signals)?;
    thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                info!("signal {sig}: shutting down");
                for p in &paths {
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
    let (st1, st2) = (state.clone(), state.clone());
    let hooks = Hooks {
        on_protocol_features: Box::new(move |f| st1.set_acked_protocol_features(f)),
        on_backend_channel: Box::new(move |c| st2.set_backend_channel(c)),
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
    if config.socket_path.exists() {
        let _ = std::fs::remove_file(&config.socket_path);
    }
    let listener = UnixListener::bind(&config.socket_path).map_err(|source| ServerError::Bind {
        path: config.socket_path.clone(),
        source,
    })?;
    let mut paths = vec![config.socket_path.clone()];
    if let Some(c) = &config.control_socket {
        control::spawn(c, state.clone())?;
        paths.push(c.clone());
    }
    install_signal_handler(paths)?;
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
