//! The command line, with Sidekiq's habits: `playguard [run]`, `playguard enqueue`,
//! `playguard check`, and the hidden `completions` and `man` the package is built with
//! (`generate.rs`). Flags win over `-C config/sidekiq.yml`, which wins over Sidekiq 7's
//! defaults. A configuration error is one clear line and a non-zero exit.
//! The flags are `args.rs`, `run` is `run.rs`, the other subcommands one file each.

use crate::job::handler::Registry;
use crate::manifest::jobs as manifest_jobs;
use crate::worker::error::{
    database_error, open_redis, parse_database, redis_version, report, StartError,
};
use clap::{CommandFactory, Parser};

mod args;
mod check;
mod enqueue;
mod generate;
mod run;
use args::{CheckArgs, Cli, Cmd, DbCmd, EnqueueArgs};
use run::run;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Entry point of the binary.
pub fn main() -> i32 {
    main_with(Registry::new())
}

/// Entry point for embedders: the full CLI, with Rust handlers already registered.
pub fn main_with(registry: Registry) -> i32 {
    // This executable also runs as the worker's command guardian: before anything else starts.
    if let Some(code) = crate::commands::guardian::main_if_requested() {
        return code;
    }
    let cli = Cli::parse();
    match cli.cmd {
        None => run(cli.run, registry),
        Some(Cmd::Run(a)) => run(a, registry),
        Some(Cmd::Enqueue(a)) => enqueue::enqueue(a),
        Some(Cmd::Check(a)) => check::check(a, &registry),
        Some(Cmd::Completions { shell }) => generate::completions(Cli::command(), shell),
        Some(Cmd::Man { dir }) => generate::man(Cli::command(), dir.as_deref()),
        Some(Cmd::Db(DbCmd::Schema)) => {
            print!("{}", crate::connections::db::SCHEMA);
            0
        }
        Some(Cmd::Locks(a)) => {
            let db = a.database.database_url.filter(|u| !u.is_empty());
            runtime().block_on(crate::ops::locks::command(
                &a.redis.url,
                db.as_deref(),
                a.json,
            ))
        }
        Some(Cmd::Cycles(a)) => {
            let db = a.database.database_url.filter(|u| !u.is_empty());
            runtime().block_on(crate::ops::cycles::command(
                &a.redis.url,
                db.as_deref(),
                a.key.as_deref(),
                a.limit,
                a.json,
            ))
        }
    }
}
