//! A child process driven by PID: signalled, read from, and killed when dropped, so a failing
//! test or an interrupted bench leaves nothing running.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A running child process, SIGKILLed and reaped when dropped.
pub struct Proc {
    /// Names it in panics and logs.
    pub name: String,
    pub child: Child,
    /// Kept open once its first line is read: a process writing to a closed stdout may fail.
    stdout: Option<ChildStdout>,
}

impl Proc {
    /// Spawns `cmd` with stdin closed and stdout piped (read it with [`Proc::first_line`]);
    /// stderr is left as `cmd` has it (inherited unless set).
    pub fn spawn(name: &str, mut cmd: Command) -> std::io::Result<Self> {
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::piped()).spawn()?;
        Ok(Self {
            name: name.to_string(),
            child,
            stdout: None,
        })
    }

    /// The first line the process prints on stdout (empty if it closed stdout first). Blocks
    /// until then; see [`Proc::first_line_within`] for a bounded wait.
    pub fn first_line(&mut self) -> String {
        let Some(out) = self.child.stdout.take() else {
            panic!("{}: stdout already read", self.name);
        };
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        let _ = reader.read_line(&mut line);
        self.stdout = Some(reader.into_inner());
        line
    }

    /// The first stdout line, or `None` if none came within `timeout` (the process is then
    /// left running: drop or kill it).
    pub fn first_line_within(&mut self, timeout: Duration) -> Option<String> {
        let out = self.child.stdout.take()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut reader = BufReader::new(out);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = tx.send((line, reader.into_inner()));
        });
        let (line, out) = rx.recv_timeout(timeout).ok()?;
        self.stdout = Some(out);
        Some(line)
    }

    /// The first stdout line, as JSON.
    pub fn first_json(&mut self) -> serde_json::Value {
        let line = self.first_line();
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{}: first line {line:?} is not JSON: {e}", self.name))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends `sig` (e.g. `libc::SIGTERM`) unless the process has been reaped.
    pub fn signal(&mut self, sig: libc::c_int) {
        if self.running() {
            // SAFETY: kill(2) on the PID of our own child, which has not been reaped (a reaped
            // PID could belong to another process by now).
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, sig);
            }
        }
    }

    /// SIGSTOP: the process stops as a hung one would, its sockets open.
    pub fn pause(&mut self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`Proc::pause`].
    pub fn resume(&mut self) {
        self.signal(libc::SIGCONT);
    }

    /// Waits up to `timeout` for the process to exit (after a signal, say).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL, then reap.
    pub fn kill(mut self) {
        self.kill_now();
    }

    fn kill_now(&mut self) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait();
        self.stdout = None;
    }

    /// SIGTERM, then wait up to `timeout` for the exit status (the process is killed when
    /// dropped if it has not exited).
    pub fn terminate(mut self, timeout: Duration) -> Option<ExitStatus> {
        self.signal(libc::SIGTERM);
        self.wait_exit(timeout)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_line_then_terminate() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo ready; exec sleep 30"]);
        let mut p = Proc::spawn("sh", cmd).unwrap();
        assert_eq!(p.first_line(), "ready\n");
        assert!(p.running());
        let status = p
            .terminate(Duration::from_secs(5))
            .expect("exits on SIGTERM");
        assert!(!status.success());
    }

    #[test]
    fn a_silent_process_times_out_and_is_killed_on_drop() {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        let mut p = Proc::spawn("sleep", cmd).unwrap();
        assert_eq!(p.first_line_within(Duration::from_millis(100)), None);
        let pid = p.pid();
        drop(p);
        // SAFETY: signal 0 only asks whether the PID exists.
        let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
        assert!(!alive, "the child outlived its Proc");
    }
}
