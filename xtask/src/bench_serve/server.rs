//! Starting and stopping the two servers, ours (`k3-serve --serve`) and llama.cpp's
//! `llama-server`: each on a free loopback port, its output in a log file (a pipe nobody
//! reads would stall it), ready once `GET /health` answers 200, stopped with SIGTERM.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::client::get_status;

/// Loading the real checkpoint from a cold page cache takes minutes on a small machine.
const START_TIMEOUT: Duration = Duration::from_secs(900);
/// After SIGTERM, a server that is still up this much later is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of a failed server's log shown in the error.
const LOG_TAIL: usize = 20;

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Engine {
    Ours,
    Peer,
}

impl Engine {
    pub(super) fn name(self) -> &'static str {
        match self {
            Engine::Ours => "k3-serve",
            Engine::Peer => "llama-server",
        }
    }
}

/// How to start one engine: what does not change between its runs.
#[derive(Debug)]
pub(super) struct Launcher {
    pub(super) engine: Engine,
    pub(super) binary: PathBuf,
    /// The checkpoint directory (ours) or its GGUF (the peer's).
    pub(super) model: PathBuf,
    pub(super) threads: usize,
    /// Context per sequence.
    pub(super) ctx: usize,
    /// Further arguments (ours: `--step-tokens N`; the peer's: its chat template).
    pub(super) extra: Vec<String>,
    /// Where the logs go.
    pub(super) log_dir: PathBuf,
}

impl Launcher {
    /// Starts the server with `slots` sequences decoded together, and waits until it is
    /// healthy. `no_prompt_cache`: no prefix reuse across requests, not even of the chat
    /// template's, so that every prompt is prefilled whole.
    pub(super) fn start(&self, slots: usize, no_prompt_cache: bool) -> Result<Server> {
        let port = free_port()?;
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let mut command = Command::new(&self.binary);
        let (threads, port) = (self.threads.to_string(), port.to_string());
        match self.engine {
            Engine::Ours => {
                command
                    .args(["--serve", "--model"])
                    .arg(&self.model)
                    .args(["--host", "127.0.0.1", "--port", &port])
                    .args(["--threads", &threads, "--max-batch", &slots.to_string()])
                    .args(["--ctx", &self.ctx.to_string(), "--no-usage-cache"]);
                if no_prompt_cache {
                    command.args(["--prompt-cache-gb", "0"]);
                }
            }
            Engine::Peer => {
                // Without a unified KV cache, each of the `--parallel` slots gets `-c / slots`.
                command
                    .arg("-m")
                    .arg(&self.model)
                    .args(["--host", "127.0.0.1", "--port", &port])
                    .args(["-t", &threads, "--parallel", &slots.to_string()])
                    .args(["-c", &(self.ctx * slots).to_string(), "--cont-batching"])
                    .arg("--no-webui");
                if no_prompt_cache {
                    // Neither the RAM cache nor a slot's KV of its previous prompt.
                    command.args(["--cache-ram", "0", "--no-cache-prompt"]);
                }
            }
        }
        command.args(&self.extra);
        std::fs::create_dir_all(&self.log_dir)?;
        let log = self
            .log_dir
            .join(format!("{}-{port}.log", self.engine.name()));
        let out = File::create(&log).with_context(|| log.display().to_string())?;
        let child = command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {}", self.binary.display()))?;
        let mut server = Server {
            child,
            addr,
            log,
            name: self.engine.name(),
        };
        server.wait_healthy()?;
        Ok(server)
    }
}

/// A running server; dropped without [`Server::stop`] (an error path), it is killed.
#[derive(Debug)]
pub(super) struct Server {
    child: Child,
    pub(super) addr: SocketAddr,
    log: PathBuf,
    name: &'static str,
}

impl Server {
    fn wait_healthy(&mut self) -> Result<()> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited with {status} before it was healthy; its log ({}) ends:\n{}",
                    self.name,
                    self.log.display(),
                    self.log_tail()
                );
            }
            if get_status(self.addr, "/health").is_ok_and(|s| s == 200) {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "{} did not answer GET /health with 200 within {} s; its log ({}) ends:\n{}",
                    self.name,
                    START_TIMEOUT.as_secs(),
                    self.log.display(),
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// SIGTERM, then waits for the exit (a kill after [`STOP_TIMEOUT`]).
    pub(super) fn stop(mut self) -> Result<()> {
        // SAFETY: `kill` only sends a signal; the pid is our child's, not yet reaped (it is
        // reaped below or in `Drop`), so it names no other process.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let started = Instant::now();
        while self.child.try_wait()?.is_none() {
            if started.elapsed() > STOP_TIMEOUT {
                eprintln!(
                    "{} ignored SIGTERM for {} s: killing it",
                    self.name,
                    STOP_TIMEOUT.as_secs()
                );
                self.child.kill()?;
                self.child.wait()?;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The log's last lines, without a backtrace's frames (the message is above them).
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let frame = |l: &str| {
            let l = l.trim_start();
            let digits = l.bytes().take_while(u8::is_ascii_digit).count();
            l.starts_with("at ") || (digits > 0 && l[digits..].starts_with(": "))
        };
        let lines: Vec<&str> = text.lines().filter(|l| !frame(l)).collect();
        lines[lines.len().saturating_sub(LOG_TAIL)..].join("\n")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A loopback port nobody listens on now (the OS's pick; free again once returned).
fn free_port() -> Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}
