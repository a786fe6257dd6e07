//! `core-hub pki init|issue|revoke`: the fleet CA, device certificates and revocation.

use anyhow::Result;
use clap::Subcommand;
use core_hub::pki;
use std::path::PathBuf;

/// `println!` that reports a closed stdout instead of panicking.
macro_rules! say {
    ($($t:tt)*) => {
        super::output::print(&format!("{}\n", format_args!($($t)*)))?
    };
}

#[derive(Subcommand, Debug)]
pub enum PkiCmd {
    /// Create the fleet CA and the hub certificate.
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// Extra DNS name or IP for the hub certificate (repeatable).
        #[arg(long = "san")]
        sans: Vec<String>,
        /// Replace an existing CA.
        #[arg(long)]
        force: bool,
    },
    /// Issue a device certificate (CN = device id).
    Issue {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        #[arg(long)]
        out: PathBuf,
        /// Validity in years.
        #[arg(long, default_value_t = pki::DEVICE_CERT_YEARS)]
        years: i32,
        /// Replace an existing device.key / device.pem in --out.
        #[arg(long)]
        force: bool,
    },
    /// Revoke a device; a running hub reloads the list.
    Revoke {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        device: String,
        /// Revoke only the certificate with this serial, not every certificate of the device.
        /// Hex in any form `openssl x509` prints (`42:bb:57`, `serial=42BB57`); it must be one
        /// `pki issue` recorded for the device in DIR/issued.txt.
        #[arg(long)]
        serial: Option<String>,
    },
}

pub fn pki(cmd: PkiCmd) -> Result<()> {
    match cmd {
        PkiCmd::Init { dir, sans, force } => {
            let out = pki::init(&dir, &sans, force)?;
            say!(
                "wrote {}, {}, {}, {}",
                out.ca_pem.display(),
                out.ca_key.display(),
                out.hub_pem.display(),
                out.hub_key.display()
            );
        }
        PkiCmd::Issue {
            dir,
            device,
            out,
            years,
            force,
        } => {
            let o = pki::issue_with_years(&dir, &device, &out, years, force)?;
            say!(
                "wrote {}, {}, {} (serial {})",
                o.ca_pem.display(),
                o.device_pem.display(),
                o.device_key.display(),
                o.serial
            );
        }
        PkiCmd::Revoke {
            dir,
            device,
            serial,
        } => {
            let out = pki::revoke(&dir, &device, serial.as_deref())?;
            if let Some(warning) = &out.warning {
                eprintln!("warning: {warning}");
            }
            match &out.serial {
                Some(s) => say!("revoked {device} serial {s} in {}", out.path.display()),
                None => say!("revoked {device} in {}", out.path.display()),
            }
        }
    }
    Ok(())
}
