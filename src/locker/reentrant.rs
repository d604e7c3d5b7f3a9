//! Opt-in reentrancy (`LockerBuilder::reentrant`): a thread that holds a key through a
//! `Locker` and locks it again gets a nested guard, with no database round trip; the lock is
//! released when the last of the nested guards goes.

use crate::hold::{Hold, Taken};
use crate::sync::Unpoison;
use crate::Result;
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

/// The keys a reentrant `Locker`'s guards hold, with the thread that took each.
#[derive(Default)]
pub(crate) struct Nests {
    map: Mutex<HashMap<String, Arc<Nest>>>,
}

/// One held key and its nested guards.
struct Nest {
    thread: ThreadId,
    token: i64,
    acquired_at: DateTime<Utc>,
    state: Mutex<State>,
}

struct State {
    /// Guards alive; 0 once the lock is being released.
    count: usize,
    /// The strategy's hold, released with the last guard.
    hold: Option<Box<dyn Hold>>,
}

impl Nest {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unpoisoned()
    }
}

impl Nests {
    fn map(&self) -> MutexGuard<'_, HashMap<String, Arc<Nest>>> {
        self.map.lock().unpoisoned()
    }

    /// A nested acquisition: `Some` if this thread holds `key` through this `Locker`.
    pub(crate) fn nested(self: &Arc<Self>, key: &str) -> Option<Taken> {
        let nest = self.map().get(key).cloned()?;
        if nest.thread != std::thread::current().id() {
            return None;
        }
        {
            let mut st = nest.state();
            if st.count == 0 {
                return None;
            }
            st.count += 1;
        }
        Some(Taken {
            token: nest.token,
            acquired_at: nest.acquired_at,
            hold: Box::new(NestHold {
                nests: self.clone(),
                nest,
            }),
        })
    }

    /// A first acquisition by this thread: its hold becomes the nest's.
    pub(crate) fn first(self: &Arc<Self>, key: &str, taken: Taken) -> Taken {
        let nest = Arc::new(Nest {
            thread: std::thread::current().id(),
            token: taken.token,
            acquired_at: taken.acquired_at,
            state: Mutex::new(State {
                count: 1,
                hold: Some(taken.hold),
            }),
        });
        self.map().insert(key.to_owned(), nest.clone());
        Taken {
            token: taken.token,
            acquired_at: taken.acquired_at,
            hold: Box::new(NestHold {
                nests: self.clone(),
                nest,
            }),
        }
    }
}

/// One guard's share of a nest.
struct NestHold {
    nests: Arc<Nests>,
    nest: Arc<Nest>,
}

impl Hold for NestHold {
    fn release(self: Box<Self>, key: &str) -> Result<bool> {
        let hold = {
            let mut st = self.nest.state();
            st.count -= 1;
            if st.count > 0 {
                return Ok(true);
            }
            st.hold.take()
        };
        {
            let mut map = self.nests.map();
            if map.get(key).is_some_and(|n| Arc::ptr_eq(n, &self.nest)) {
                map.remove(key);
            }
        }
        match hold {
            Some(hold) => hold.release(key),
            None => Ok(false),
        }
    }

    fn held(&self, key: &str) -> Result<bool> {
        match &self.nest.state().hold {
            Some(hold) => hold.held(key),
            None => Ok(false),
        }
    }
}
