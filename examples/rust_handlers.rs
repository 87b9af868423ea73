//! Embedding playguard: register Rust handlers and a Rust-phased reconcile cycle, then hand over
//! to the normal CLI (`cargo run --example rust_handlers -- -q default`). Manifest jobs from
//! `jobs/` are still loaded beside them.
//!
//! Try it: `cargo run --example rust_handlers -- enqueue Greeter '"world"'`, then run it.

use playguard::reconcile::Cycle;
use playguard::{Failure, Registry};
use std::time::Duration;

fn main() {
    let mut registry = Registry::new();

    // A plain job: Ok(()) is done; Err(Failure) is retried the Sidekiq way.
    registry.register_fn("Greeter", |ctx| async move {
        let who = ctx
            .args
            .first()
            .and_then(|v| v.as_str())
            .unwrap_or("nobody")
            .to_string();
        if who.is_empty() {
            return Err(Failure::new("ArgumentError", "empty name"));
        }
        tracing::info!("hello, {who}");
        Ok(())
    });

    // A phased job under a per-Marquee token lock, renewed after every phase. Each phase sees
    // the fencing token to pass to its downstream writes.
    let cycle = Cycle::new("playguard:rust-marquee:{args.0}", Duration::from_secs(60))
        .label("Marquee {args.0}")
        .phase_fn("sync_git", |p| async move {
            tracing::info!(fence = p.fence, "syncing git for {:?}", p.args);
            Ok(())
        })
        .phase_fn("reconcile_playgrounds", |p| async move {
            // Write downstream only with the fence: a stale holder's write is then rejected.
            let wrote = playguard::lock::fenced_set(
                &p.redis,
                &format!("demo:marquee-state:{}", p.args[0]),
                p.fence,
                "reconciled",
            )
            .await
            .map_err(|e| Failure::new("RedisError", e.to_string()))?;
            tracing::info!(wrote, "state written under fence {}", p.fence);
            Ok(())
        });
    registry.register("RustMarqueeJob", cycle);

    std::process::exit(playguard::cli::main_with(registry));
}
