//! The crate's one module with `unsafe` code: a libpq connection of the PostgreSQL
//! listener's own (`pg/listen.rs`) that can *block* until a notification arrives. diesel's
//! `PgConnection` can only poll for notifications (it exposes neither the socket nor a
//! blocking wait), which costs a wake-up every few hundred microseconds while anyone waits;
//! here the thread sleeps in `poll(2)` on the connection's socket and on a wake-up socket of
//! its own until either has something to read.
//!
//! What is unsafe is the FFI itself (libpq through `pq-sys`, the same library diesel's
//! connections use, so TLS, authentication and the URL's parameters behave alike, and
//! `poll` through `libc`). Each call's conditions are stated where it is made. The
//! connection is owned by one `RawListener`, used through `&mut self` only, and finished
//! once, in `Drop`.
#![allow(unsafe_code)]

use pq_sys::{ConnStatusType, ExecStatusType, PGconn};
use std::ffi::{CStr, CString};
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::time::Duration;

/// One notification: its channel and payload.
#[derive(Debug)]
pub(crate) struct Notified {
    pub(crate) channel: String,
    pub(crate) payload: String,
}

/// A libpq connection used only to `LISTEN` and wait.
pub(crate) struct RawListener {
    conn: NonNull<PGconn>,
}

// SAFETY: libpq connections may move between threads; what libpq forbids is using one from
// two threads at once, which `&mut self` on every use rules out.
unsafe impl Send for RawListener {}

impl RawListener {
    /// Connects to `url` (a libpq connection string or URI). The error is libpq's message,
    /// which never contains the password.
    pub(crate) fn connect(url: &str) -> Result<RawListener, String> {
        let url = CString::new(url).map_err(|_| "the URL contains a NUL byte".to_owned())?;
        // SAFETY: `url` is a NUL-terminated string that outlives the call; libpq copies what
        // it keeps. A null return means libpq could not allocate the connection object.
        let conn = unsafe { pq_sys::PQconnectdb(url.as_ptr()) };
        let conn = NonNull::new(conn).ok_or_else(|| "libpq is out of memory".to_owned())?;
        let listener = RawListener { conn };
        // SAFETY: `conn` is the live connection `listener` owns.
        if unsafe { pq_sys::PQstatus(conn.as_ptr()) } != ConnStatusType::CONNECTION_OK {
            return Err(listener.error()); // dropped: PQfinish frees it
        }
        // libpq prints the server's notices and the reason a connection ended (`FATAL:
        // terminating connection …`) on stderr unless told otherwise: to the log instead.
        // SAFETY: the connection is live; `notice` is a plain function that stays valid for
        // the program's life and uses its message only during the call.
        unsafe {
            pq_sys::PQsetNoticeProcessor(conn.as_ptr(), Some(notice), std::ptr::null_mut());
        }
        Ok(listener)
    }

    /// libpq's last error message on this connection.
    fn error(&self) -> String {
        // SAFETY: PQerrorMessage returns a NUL-terminated string owned by the connection,
        // valid until the next call on it; it is copied before anything else runs.
        let msg = unsafe { CStr::from_ptr(pq_sys::PQerrorMessage(self.conn.as_ptr())) };
        let msg = msg.to_string_lossy().trim().to_owned();
        if msg.is_empty() {
            "the connection failed".to_owned()
        } else {
            msg
        }
    }

    /// Runs a statement that returns no rows (`LISTEN …`).
    pub(crate) fn execute(&mut self, sql: &str) -> Result<(), String> {
        let sql = CString::new(sql).map_err(|_| "the statement contains a NUL byte".to_owned())?;
        // SAFETY: the connection is live and used by this thread only; `sql` outlives the
        // call. The result (possibly null) is cleared below, once.
        let res = unsafe { pq_sys::PQexec(self.conn.as_ptr(), sql.as_ptr()) };
        // SAFETY: PQresultStatus takes a null result too (PGRES_FATAL_ERROR).
        let ok = unsafe { pq_sys::PQresultStatus(res) } == ExecStatusType::PGRES_COMMAND_OK;
        // SAFETY: `res` came from PQexec and is not used after this; PQclear takes null.
        unsafe { pq_sys::PQclear(res) };
        if ok {
            Ok(())
        } else {
            Err(self.error())
        }
    }

    /// Waits until a notification arrives, `wake` has something to read, or `timeout`
    /// passes (`None`: no limit), and returns the notifications received (none when woken
    /// or timed out). An error means the connection is lost.
    pub(crate) fn wait(
        &mut self,
        timeout: Option<Duration>,
        wake: RawFd,
    ) -> Result<Vec<Notified>, String> {
        let heard = self.drain()?;
        if !heard.is_empty() {
            return Ok(heard);
        }
        // SAFETY: the connection is live; PQsocket only reads it.
        let fd = unsafe { pq_sys::PQsocket(self.conn.as_ptr()) };
        if fd < 0 {
            return Err(self.error());
        }
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: wake,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ms = timeout.map_or(-1, |t| {
            i32::try_from(t.as_millis().max(1)).unwrap_or(i32::MAX)
        });
        // SAFETY: `fds` is a valid array of two pollfd that outlives the call, and both
        // descriptors are open (the connection's, and `wake`, which the caller owns).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(Vec::new()),
                _ => Err(e.to_string()),
            };
        }
        if fds[0].revents != 0 {
            return self.drain();
        }
        Ok(Vec::new())
    }

    /// Reads what the socket has and takes the notifications libpq parsed.
    fn drain(&mut self) -> Result<Vec<Notified>, String> {
        // SAFETY: the connection is live and used by this thread only.
        if unsafe { pq_sys::PQconsumeInput(self.conn.as_ptr()) } == 0 {
            return Err(self.error());
        }
        let mut heard = Vec::new();
        loop {
            // SAFETY: as above; a non-null result is a PGnotify that this code owns and
            // frees with PQfreemem below, after copying its strings.
            let n = unsafe { pq_sys::PQnotifies(self.conn.as_ptr()) };
            let Some(n) = NonNull::new(n) else {
                return Ok(heard);
            };
            // SAFETY: `relname` and `extra` are NUL-terminated strings inside the PGnotify,
            // valid until it is freed.
            let (channel, payload) = unsafe {
                let n = n.as_ref();
                (
                    CStr::from_ptr(n.relname).to_string_lossy().into_owned(),
                    CStr::from_ptr(n.extra).to_string_lossy().into_owned(),
                )
            };
            // SAFETY: `n` came from PQnotifies and is not used after this.
            unsafe { pq_sys::PQfreemem(n.as_ptr().cast()) };
            heard.push(Notified { channel, payload });
        }
    }
}

/// libpq's notice processor for the listener's connection: the message to the log.
unsafe extern "C" fn notice(_arg: *mut std::ffi::c_void, message: *const std::ffi::c_char) {
    if message.is_null() {
        return;
    }
    // SAFETY: libpq passes a NUL-terminated message, valid during the call.
    let message = unsafe { CStr::from_ptr(message) }.to_string_lossy();
    log::debug!("release listener: {}", message.trim());
}

impl Drop for RawListener {
    fn drop(&mut self) {
        // SAFETY: the connection is live and owned by this value, which is going away;
        // nothing uses it after this.
        unsafe { pq_sys::PQfinish(self.conn.as_ptr()) };
    }
}
