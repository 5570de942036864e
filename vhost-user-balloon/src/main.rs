//! vhost-user-balloon daemon entry point.

use clap::Parser;
use vhost_user_balloon::cli::{Args, Config};

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    env_logger::Builder::new()
        .filter_level(args.log_level.filter())
        .init();
    let result = Config::try_from(args)
        .map_err(|e| e.to_string())
        .and_then(|c| vhost_user_balloon::server::run(c).map_err(|e| e.to_string()));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            log::error!("{e}");
            eprintln!("vhost-user-balloon: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
