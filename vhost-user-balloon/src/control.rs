//! Operator control socket: JSON lines over a UNIX stream socket. Every
//! request line gets exactly one response line. See README.md for the
//! protocol.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use log::{debug, warn};
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

use crate::backend::DeviceState;
use crate::spec;

/// Longest accepted request line.
pub const MAX_LINE: usize = 64 * 1024;
/// Default time `get_stats` waits for fresh statistics.
pub const DEFAULT_STATS_WAIT_MS: u64 = 1000;

/// Error of this module.
#[derive(Debug, Error)]
pub enum ControlError {
    /// Binding the socket failed.
    #[error("cannot bind control socket {path}: {source}")]
    Bind {
        /// socket path
        path: PathBuf,
        /// cause
        source: io::Error,
    },
    /// Spawning the accept thread failed.
    #[error("cannot spawn control thread: {0}")]
    Spawn(io::Error),
}

/// A control request.
#[derive(Debug, Deserialize, PartialEq, Eq)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// Set the balloon target (`num_pages`, 4 KiB pages) and notify the guest.
    SetTarget {
        /// target in 4 KiB pages
        pages: u32,
    },
    /// Latest guest memory statistics; by default first asks the guest for
    /// fresh ones and waits up to `wait_ms`.
    GetStats {
        /// ask the guest for fresh statistics first (default true)
        #[serde(default)]
        refresh: Option<bool>,
        /// how long to wait for them (default 1000 ms)
        #[serde(default)]
        wait_ms: Option<u64>,
    },
    /// Counters, negotiated features, `actual`, target.
    GetCounters,
    /// The config space as the guest sees it.
    GetConfig,
}

fn hex(v: u64) -> String {
    format!("{v:#x}")
}

fn stats_json(s: &crate::backend::StatsRecord) -> Value {
    let values: serde_json::Map<String, Value> = s
        .stats
        .iter()
        .map(|st| (spec::stat_name(st.tag), json!(st.val)))
        .collect();
    json!({"generation": s.generation, "received_unix": s.received_unix, "values": values})
}

/// Executes one request line and returns the response (without newline).
pub fn handle_line(state: &DeviceState, line: &str) -> String {
    let cmd: Command = match serde_json::from_str(line) {
        Ok(c) => c,
        Err(e) => return json!({"ok": false, "error": format!("bad request: {e}")}).to_string(),
    };
    debug!("control: {cmd:?}");
    let v = match cmd {
        Command::SetTarget { pages } => match state.set_target(pages) {
            Ok(u) => json!({"ok": true, "target": u.pages, "notified": u.notified}),
            Err(e) => json!({"ok": false, "target": pages, "error": e.to_string()}),
        },
        Command::GetStats { refresh, wait_ms } => {
            let res = if refresh.unwrap_or(true) && state.connected() {
                let wait =
                    Duration::from_millis(wait_ms.unwrap_or(DEFAULT_STATS_WAIT_MS).min(60_000));
                state.request_stats(wait)
            } else {
                Ok(state.stats())
            };
            match res {
                Ok(Some(s)) => json!({"ok": true, "stats": stats_json(&s)}),
                Ok(None) => json!({"ok": true, "stats": Value::Null}),
                Err(e) => json!({"ok": false, "error": e.to_string()}),
            }
        }
        Command::GetCounters => {
            let acked = state.acked_features();
            let (reported, inflate) = state.init_guarantees();
            let (cfg, counters) = state.config_and_counters();
            json!({
                "ok": true,
                "connected": state.connected(),
                "target": cfg.num_pages,
                "actual": cfg.actual,
                "poison_val": cfg.poison_val,
                "features": {
                    "offered": hex(state.offered_features()),
                    "negotiated": hex(acked),
                    "negotiated_names": spec::feature_names(acked),
                    "protocol_negotiated": hex(state.acked_protocol_features()),
                },
                "init_guarantees": {
                    "device_init_reported": reported,
                    "device_init_on_inflate": inflate,
                },
                "counters": counters,
            })
        }
        Command::GetConfig => json!({"ok": true, "config": state.config()}),
    };
    v.to_string()
}

fn serve_client(state: &DeviceState, stream: UnixStream) -> io::Result<()> {
    let mut out = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        let n = (&mut reader).take(MAX_LINE as u64).read_line(&mut line)?;
        if n == 0 {
            return Ok(());
        }
        if !line.ends_with('\n') && n >= MAX_LINE {
            out.write_all(b"{\"ok\":false,\"error\":\"line too long\"}\n")?;
            return Ok(());
        }
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        let mut resp = handle_line(state, trimmed);
        resp.push('\n');
        out.write_all(resp.as_bytes())?;
    }
}

use std::io::Read as _;

/// Serves the control socket `listener` (see `server::listen_at`) from a
/// background thread, one thread per client.
pub fn spawn(listener: UnixListener, state: Arc<DeviceState>) -> Result<(), ControlError> {
    thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        let st = state.clone();
                        let r =
                            thread::Builder::new()
                                .name("control-client".into())
                                .spawn(move || {
                                    if let Err(e) = serve_client(&st, s) {
                                        debug!("control client: {e}");
                                    }
                                });
                        if let Err(e) = r {
                            warn!("cannot spawn control client thread: {e}");
                        }
                    }
                    Err(e) => warn!("control accept: {e}"),
                }
            }
        })
        .map_err(ControlError::Spawn)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_commands() {
        let c: Command = serde_json::from_str(r#"{"cmd":"set_target","pages":42}"#).unwrap();
        assert_eq!(c, Command::SetTarget { pages: 42 });
        let c: Command = serde_json::from_str(r#"{"cmd":"get_stats"}"#).unwrap();
        assert_eq!(
            c,
            Command::GetStats {
                refresh: None,
                wait_ms: None
            }
        );
        assert!(serde_json::from_str::<Command>(r#"{"cmd":"set_target","pages":-1}"#).is_err());
        assert!(serde_json::from_str::<Command>(r#"{"cmd":"nope"}"#).is_err());
    }

    #[test]
    fn handle_requests_without_frontend() {
        let st = DeviceState::new(0).unwrap();
        let r: Value =
            serde_json::from_str(&handle_line(&st, r#"{"cmd":"set_target","pages":256}"#)).unwrap();
        assert_eq!(r["ok"], true);
        assert_eq!(r["notified"], false);
        assert_eq!(st.target(), 256);
        let r: Value =
            serde_json::from_str(&handle_line(&st, r#"{"cmd":"get_counters"}"#)).unwrap();
        assert_eq!(r["target"], 256);
        assert_eq!(r["counters"]["inflated_pages"], 0);
        let r: Value = serde_json::from_str(&handle_line(&st, r#"{"cmd":"get_stats"}"#)).unwrap();
        assert_eq!(r["stats"], Value::Null);
        let r: Value = serde_json::from_str(&handle_line(&st, "garbage")).unwrap();
        assert_eq!(r["ok"], false);
        let r: Value = serde_json::from_str(&handle_line(&st, r#"{"cmd":"get_config"}"#)).unwrap();
        assert_eq!(r["config"]["num_pages"], 256);
    }
}
