//! Who this process is: Sidekiq's identity string (`hostname:pid:nonce`, the key of its
//! `processes` entry and of every per-process key), the hostname as Sidekiq picks it, and
//! the kernel boot and pid namespace (so a sweep only trusts a pid check on the same host).
//! Touches no Redis keys.

/// This kernel boot and pid namespace, e.g. "3f2c…:pid:[4026531836]"; empty if unknown.
pub fn pid_namespace() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    if boot.trim().is_empty() || ns.is_empty() {
        return String::new();
    }
    format!("{}:{ns}", boot.trim())
}

/// A fresh identity: hostname:pid:nonce, the nonce new at every start (SecureRandom.hex(6)).
pub fn new_identity() -> String {
    let nonce: [u8; 6] = rand::random();
    let nonce: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}:{}:{}", hostname(), std::process::id(), nonce)
}

/// As launcher.rb: `$DYNO` (Heroku) wins over the system hostname.
pub fn hostname() -> String {
    if let Some(d) = std::env::var("DYNO").ok().filter(|d| !d.is_empty()) {
        return d;
    }
    hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "localhost".into())
}
