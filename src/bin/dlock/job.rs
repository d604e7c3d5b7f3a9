//! The command's process: `Job` starts it so that it cannot outlive dlock and holds nothing
//! of dlock's (a process group of its own unless dlock has the terminal, the `Guardian` that
//! kills that group when dlock dies, `PR_SET_PDEATHSIG`, every descriptor but the inherited
//! ones close-on-exec), signals it, stops and reaps what it leaves in its group; and the
//! words and exit codes for how it ended.

use crate::args::{deadline_after, EXIT_RUNTIME};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::process::{Child, Command as ProcessCommand, ExitStatus};
use std::time::{Duration, Instant};

/// The running command. Dropped before it was reaped (an error or a panic in dlock), it is
/// killed, with its process group.
pub(crate) struct Job {
    pub(crate) child: Child,
    /// The command leads a process group of its own (pgid = its pid).
    pub(crate) own_group: bool,
    pub(crate) reaped: bool,
    /// With a group of its own: the process that kills the group should dlock die.
    guardian: Option<Guardian>,
}

/// A small `sh` in a process group of its own that kills the command's process group when
/// dlock dies, however it dies: it reads the group's id, then waits on a pipe whose only
/// writer is dlock. The command writes the id itself, in one `write`, before it execs: from
/// its first instruction on, the group is guarded (were dlock to write it after the spawn, a
/// dlock killed in between would leave the guardian unarmed, and what the command had
/// forked would run on beside the next holder). End of file (dlock gone) means SIGKILL to
/// the whole group: the parent-
/// death signal reaches only the command itself, not what a shell command runs in its
/// foreground. dlock says "done" once the group is empty, and the guardian just exits.
struct Guardian {
    child: Child,
    pipe: std::process::ChildStdin,
}

/// The guardian's script (POSIX sh: dash's `kill` takes a negative pid only after `-s` and
/// `--`). The group's id comes through the pipe, never through the text. It holds dlock's
/// database connections, so the server sees them close, and frees a session lock, only at
/// its exit, after the SIGKILL has been sent to the group. (Waiting for the group to be gone
/// as well would wait for its zombies, which an init that reaps slowly keeps for seconds;
/// a process with a pending SIGKILL runs no more of its own code.)
const GUARDIAN: &str = "trap '' INT HUP TERM QUIT; \
    read g || exit 0; \
    read _ && exit 0; \
    kill -s KILL -- \"-$g\" 2>/dev/null";

impl Guardian {
    /// Starts the guardian with its pipe, the descriptors in `keep` and none other of dlock's.
    fn start(keep: &[RawFd]) -> io::Result<Guardian> {
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        let mut sh = ProcessCommand::new("/bin/sh");
        sh.args(["-c", GUARDIAN])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        let keep = keep.to_vec();
        // SAFETY: as for the command's pre_exec below: async-signal-safe system calls only
        // (fcntl), on memory allocated before the fork.
        unsafe {
            sh.pre_exec(move || {
                cloexec_all_but(&keep);
                // Kept across the exec even where they were opened close-on-exec (libpq's
                // sockets are): the flag is this process's own copy, dlock's is unchanged.
                for &fd in &keep {
                    libc::fcntl(fd, libc::F_SETFD, 0);
                }
                Ok(())
            });
        }
        let mut child = sh.spawn()?;
        let pipe = child.stdin.take().expect("piped stdin");
        Ok(Guardian { child, pipe })
    }

    /// The group is empty: the guardian exits without killing anything.
    fn disarm(mut self) {
        let _ = writeln!(self.pipe, "done");
        drop(self.pipe);
        let _ = self.child.wait();
    }
}

impl Job {
    /// Starts the command so that it cannot outlive dlock and holds nothing of dlock's:
    ///
    /// - it gets SIGKILL when dlock dies, however dlock dies (Linux: `PR_SET_PDEATHSIG`;
    ///   it is tied to the thread that forks, so this must be the main thread, which lives
    ///   as long as dlock);
    /// - unless dlock has the terminal (then the command must share its process group to
    ///   read the terminal and get its Ctrl-C and Ctrl-Z), it leads a process group of its
    ///   own, so that the signals dlock passes on, and the SIGTERM/SIGKILL of a lost lock,
    ///   reach its children too;
    /// - no descriptor of dlock's reaches it: every descriptor above stderr is made
    ///   close-on-exec, except those dlock itself inherited (a make jobserver, sockets
    ///   passed by systemd), which pass through as they would without dlock. A database
    ///   socket left open in the command (libmariadb opens its sockets without
    ///   close-on-exec) would keep dlock's session, and a session lock with it, alive for
    ///   as long as the command or any background job of it runs.
    pub(crate) fn spawn(mut command: ProcessCommand, inherited_fds: Vec<RawFd>) -> io::Result<Job> {
        use std::os::unix::process::CommandExt;
        let own_group = !has_the_terminal();
        if own_group {
            command.process_group(0);
        }
        let parent = libc_pid(std::process::id());
        let mut keep = inherited_fds;
        keep.retain(|&fd| fd > 2);
        keep.sort_unstable();
        keep.dedup();
        // Started first, so that no moment of the command's life goes unguarded. It also
        // keeps dlock's sockets (the database connections, the session lock's among them):
        // should dlock die, the server sees the session close, and frees a session lock, only
        // once the guardian has killed the group and exited, never while the group's work
        // still runs (were only dlock to hold them, the next holder could start a few ms
        // before the guardian's kill landed).
        let guardian = if own_group {
            let mut guardian_keeps = keep.clone();
            guardian_keeps.extend(own_sockets());
            guardian_keeps.sort_unstable();
            guardian_keeps.dedup();
            Some(Guardian::start(&guardian_keeps)?)
        } else {
            None
        };
        // The write end of the guardian's pipe, in the command until its exec (close-on-exec,
        // as std makes every pipe).
        let arm = guardian
            .as_ref()
            .map(|g| std::os::fd::AsRawFd::as_raw_fd(&g.pipe));
        // SAFETY: the closure runs in the child between fork and exec, and only makes
        // async-signal-safe system calls (prctl, getppid, getpid, write, close_range or
        // fcntl, getrlimit, _exit) on memory allocated before the fork or on its own stack;
        // it allocates nothing, takes no lock.
        unsafe {
            command.pre_exec(move || {
                #[cfg(any(target_os = "linux", target_os = "android"))]
                {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                // dlock may have died before the line above: then nobody would ever send
                // the signal.
                if libc::getppid() != parent {
                    libc::_exit(i32::from(EXIT_RUNTIME));
                }
                // Arms the guardian: our pid is our group's id (std made us its leader
                // before this closure runs). Should dlock die from here on, the guardian
                // sees the end of its pipe once we exec, and kills the group.
                if let Some(fd) = arm {
                    let (line, len) = decimal_line(libc::getpid());
                    loop {
                        let n = libc::write(fd, line.as_ptr().cast(), len);
                        if n == len as isize {
                            break;
                        }
                        if n >= 0 || *libc::__errno_location() != libc::EINTR {
                            return Err(io::Error::last_os_error());
                        }
                    }
                }
                cloexec_all_but(&keep);
                Ok(())
            });
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) => {
                // The command may have armed the guardian before its exec failed; its group
                // is gone, and no other group may be killed in its name.
                if let Some(g) = guardian {
                    g.disarm();
                }
                return Err(e);
            }
        };
        Ok(Job {
            child,
            own_group,
            reaped: false,
            guardian,
        })
    }

    /// The command's group is empty: its guardian may go.
    pub(crate) fn disarm(&mut self) {
        if let Some(g) = self.guardian.take() {
            g.disarm();
        }
    }

    /// Sends `sig` to the command, and to its whole process group when it has its own.
    pub(crate) fn signal(&self, sig: Signal) {
        if self.reaped && !self.own_group {
            return; // its pid may belong to another process by now
        }
        let pid = Pid::from_raw(libc_pid(self.child.id()));
        let target = if self.own_group {
            Pid::from_raw(-pid.as_raw())
        } else {
            pid
        };
        let _ = kill(target, sig);
    }

    /// After the command exited: its background jobs left in its process group would run on
    /// without the lock, so they get SIGTERM, and SIGKILL if still there after `kill_after`.
    /// (A job that left the group, with `setsid` for instance, is not followed.)
    pub(crate) fn stop_leftovers(&self, kill_after: Duration) {
        if !self.own_group {
            return;
        }
        let group = Pid::from_raw(-libc_pid(self.child.id()));
        if kill(group, Signal::SIGTERM).is_err() {
            return; // nothing left
        }
        log::info!("the command exited; sent SIGTERM to what it left in its process group");
        let deadline = deadline_after(Instant::now(), kill_after);
        let mut pause = Duration::from_millis(1);
        // dlock is their subreaper (see `run`): those whose parent has exited are its
        // children now, and reaped here, so that no zombie keeps the group in existence.
        // Nothing else tells when the group is empty.
        while {
            reap_group(group);
            kill(group, None).is_ok()
        } {
            if Instant::now() >= deadline {
                eprintln!("dlock: the command's background jobs did not stop after SIGTERM; sending SIGKILL");
                let _ = kill(group, Signal::SIGKILL);
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.reaped {
            self.signal(Signal::SIGKILL);
            let _ = self.child.wait();
        }
        self.disarm();
    }
}

/// dlock's own open sockets above stderr (its database connections among them).
fn own_sockets() -> Vec<RawFd> {
    open_fds()
        .into_iter()
        .filter(|&fd| {
            fd > 2
                && std::fs::read_link(format!("/proc/self/fd/{fd}"))
                    .is_ok_and(|t| t.to_string_lossy().starts_with("socket:"))
        })
        .collect()
}

/// The descriptor numbers this process has open (and that of the listing itself, closed by
/// the time this returns).
fn open_fds() -> Vec<RawFd> {
    std::fs::read_dir("/dev/fd")
        .or_else(|_| std::fs::read_dir("/proc/self/fd"))
        .map(|dir| {
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// `pid` in decimal and a newline, on the stack (for `pre_exec`, which must not allocate):
/// the bytes and how many of them count.
fn decimal_line(pid: libc::pid_t) -> ([u8; 16], usize) {
    let mut digits = [0u8; 16];
    let mut n = 0;
    let mut v = pid.unsigned_abs();
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    let mut line = [0u8; 16];
    for i in 0..n {
        line[i] = digits[n - 1 - i];
    }
    line[n] = b'\n';
    (line, n + 1)
}

/// Marks every descriptor above stderr close-on-exec but those in `keep` (sorted). Runs
/// between fork and exec: system calls only.
unsafe fn cloexec_all_but(keep: &[RawFd]) {
    let mut from: libc::c_int = 3;
    for &fd in keep {
        if fd > from {
            set_cloexec(from, fd - 1);
        }
        from = fd.saturating_add(1);
    }
    set_cloexec(from, libc::c_int::MAX);
}

/// Reaps the children of dlock's in process group `-group` that have exited (never the
/// command itself, reaped already).
fn reap_group(group: Pid) {
    let mut status = 0;
    // SAFETY: waitpid writes only to `status`.
    while unsafe { libc::waitpid(group.as_raw(), &mut status, libc::WNOHANG) } > 0 {}
}

/// Whether dlock's process group is the foreground group of the terminal on its stdin
/// (dlock was started from a shell prompt, not in the background, not by cron).
fn has_the_terminal() -> bool {
    // SAFETY: plain system calls on a descriptor number; no memory is passed.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

fn libc_pid(pid: u32) -> libc::pid_t {
    libc::pid_t::try_from(pid).unwrap_or(libc::pid_t::MAX)
}

/// The descriptors above stderr open when dlock started, before it opened any of its own:
/// those pass through to the command.
pub(crate) fn inherited_fds() -> Vec<RawFd> {
    // The listing saw its own directory's descriptor, closed by now; and descriptors that are
    // close-on-exec already would not reach the command anyway.
    open_fds()
        .into_iter()
        .filter(|&fd| {
            // SAFETY: F_GETFD only reads the flags of a descriptor number.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            fd > 2 && flags >= 0 && flags & libc::FD_CLOEXEC == 0
        })
        .collect()
}

/// Marks descriptors `from..=to` close-on-exec. Runs between fork and exec: system calls only.
unsafe fn set_cloexec(from: libc::c_int, to: libc::c_int) {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        // Linux 5.11 and later do it in one call.
        let done = libc::syscall(
            libc::SYS_close_range,
            from as libc::c_uint,
            to as libc::c_uint,
            libc::CLOSE_RANGE_CLOEXEC,
        ) == 0;
        if done {
            return;
        }
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let last = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
        libc::c_int::try_from(limit.rlim_cur.saturating_sub(1)).unwrap_or(libc::c_int::MAX)
    } else {
        1023
    };
    let mut fd = from;
    while fd <= to.min(last) {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
        fd += 1;
    }
}

pub(crate) fn exit_code(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(EXIT_RUNTIME),
        (None, Some(sig)) => 128u8.saturating_add(u8::try_from(sig).unwrap_or(0)),
        (None, None) => EXIT_RUNTIME,
    }
}

pub(crate) fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("it exited with status {code}"),
        (None, Some(sig)) => format!("it was killed by {}", signal_name(sig)),
        (None, None) => status.to_string(),
    }
}

pub(crate) fn signal_name(sig: i32) -> String {
    signal_hook::low_level::signal_name(sig)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("signal {sig}"))
}

#[cfg(test)]
mod decimal_tests {
    #[test]
    fn pids_are_written_as_decimal_lines() {
        for (pid, text) in [
            (1, "1\n"),
            (10, "10\n"),
            (4_194_304, "4194304\n"),
            (i32::MAX, "2147483647\n"),
        ] {
            let (line, len) = super::decimal_line(pid);
            assert_eq!(std::str::from_utf8(&line[..len]).unwrap(), text);
        }
    }
}
