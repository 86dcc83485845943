//! Random identifiers (passwords, instance and fault ids) from the operating system.

use anyhow::Context;
use std::io::Read;

/// `bytes` random bytes from the OS, as hex.
pub fn random_hex(bytes: usize) -> anyhow::Result<String> {
    let mut buf = vec![0u8; bytes];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .context("cannot read /dev/urandom for a password")?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}
