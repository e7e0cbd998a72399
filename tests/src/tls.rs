//! Certificates for the mutual-TLS tests, made with `openssl` in the
//! test's directory: `<name>-ca.pem` / `<name>-ca.key` for a CA, `<cn>.pem`
//! / `<cn>.key` for a certificate it signed.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Result, bail};

/// Runs `openssl` in `dir`.
pub fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A CA named `name`, and a certificate it signed for `cn` (with
/// `localhost`/127.0.0.1 as subject alternative names).
pub fn ca_and_cert(dir: &Path, name: &str, cn: &str) -> Result<()> {
    let ca_key = format!("{name}-ca.key");
    let ca = format!("{name}-ca.pem");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &ca_key,
            "-out",
            &ca,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name} test CA"),
        ],
    )?;
    cert(dir, name, cn)
}

/// A certificate for `cn` signed by the CA `ca_name` (files `<cn>.pem`,
/// `<cn>.key`), with the same alternative names.
pub fn cert(dir: &Path, ca_name: &str, cn: &str) -> Result<()> {
    let key = format!("{cn}.key");
    let csr = format!("{cn}.csr");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={cn}"),
        ],
    )?;
    std::fs::write(
        dir.join(format!("{cn}.ext")),
        format!("subjectAltName=DNS:localhost,DNS:{cn},IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"),
    )?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &format!("{ca_name}-ca.pem"),
            "-CAkey",
            &format!("{ca_name}-ca.key"),
            "-CAcreateserial",
            "-out",
            &format!("{cn}.pem"),
            "-days",
            "2",
            "-extfile",
            &format!("{cn}.ext"),
        ],
    )
}
