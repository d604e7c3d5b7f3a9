//! The in-process line of waiters per key: threads of one `Locker` waiting for the same key
//! line up first-come first-served, only the first of them asks the database, and a local
//! release wakes the next at once.

use super::cancel::Cancel;
use super::deadline::Deadline;
use crate::backend::Told;
use crate::sync::Unpoison;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The in-process line of waiters per key.
#[derive(Default)]
pub(crate) struct Queues {
    map: Mutex<HashMap<String, KeyQueue>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Keys this `Locker` found held, or taken through the line, lately (`CONTENDED_FOR`):
    /// a new call for one of them starts with the cheap look (`retry`) instead of an
    /// INSERT, which on MySQL would take the key ahead of the line and give it back, and on
    /// SQLite queue for the write lock. Pruned as it grows.
    contended: Recent,
    /// Per key, the highest `Spot::floor` a look of this `Locker` saw lately (and when):
    /// no place of the key below it lives again, so a new place starts its counts there
    /// instead of at the bottom of the key's index (on PostgreSQL that read every place the
    /// key had since the last vacuum, thousands a look in a hand-over run: each new place
    /// of a releaser re-entering the line began so). Pruned as it grows.
    floors: Mutex<HashMap<String, (i64, Instant)>>,
    /// Per key, when a guard of this `Locker` last released it (`RELEASED_FOR`): a wait for a
    /// key not released here lately is a newcomer's (`released_lately`). Pruned as it grows.
    released: Recent,
}

/// When each key last had something happen to it, for `within` afterwards: pruned of the
/// older entries once it holds 1,024 keys.
#[derive(Default)]
struct Recent(Mutex<HashMap<String, Instant>>);

impl Recent {
    /// Notes that it happened to `key` now (no allocation for a key noted before).
    fn note(&self, key: &str, within: Duration) {
        let mut m = self.0.lock().unpoisoned();
        if let Some(at) = m.get_mut(key) {
            *at = Instant::now();
            return;
        }
        if m.len() >= 1024 {
            m.retain(|_, at| at.elapsed() < within);
        }
        m.insert(key.to_owned(), Instant::now());
    }

    /// Whether it happened to `key` within the last `within`.
    fn lately(&self, key: &str, within: Duration) -> bool {
        let m = self.0.lock().unpoisoned();
        m.get(key).is_some_and(|at| at.elapsed() < within)
    }
}

/// How long after this `Locker` released a key a wait for it counts as coming back for it
/// (`released_lately`): a loop that takes a key again at once, as the benches' cycles do,
/// is well within it.
const RELEASED_FOR: Duration = Duration::from_millis(10);

/// How long a key's floor is kept without a look that raises or uses it.
const FLOOR_FOR: Duration = Duration::from_secs(60);

/// How long a key counts as contended after this `Locker` last found it so.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

struct KeyQueue {
    waiters: VecDeque<u64>,
    wake: Arc<Condvar>,
    /// Counts releases heard (local, or notified by the database), so a release that comes
    /// while the first waiter is busy with an attempt (not yet sleeping) is not missed.
    released: u64,
    /// A guard of this `Locker` holds the key: only its release is worth waking up for.
    held: bool,
    /// Grants told by their notifications (PostgreSQL), for the places' waiters to take
    /// with no look (`take_grant`); the last `TOLD_KEPT`.
    told: VecDeque<Told>,
}

/// How many grants told a key's queue keeps: one per release, taken by the waiter at once;
/// those of places whose waiter took the key by a look of its own meanwhile, or gave up,
/// are never taken (a place's id and holder id are never used again).
const TOLD_KEPT: usize = 4;

impl KeyQueue {
    fn new() -> KeyQueue {
        KeyQueue {
            waiters: VecDeque::new(),
            wake: Arc::new(Condvar::new()),
            released: 0,
            held: false,
            told: VecDeque::new(),
        }
    }
}

impl Queues {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, KeyQueue>> {
        self.map.lock().unpoisoned()
    }

    pub(super) fn join(&self, key: &str) -> Ticket<'_> {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self.lock();
        let q = map.entry(key.to_owned()).or_insert_with(KeyQueue::new);
        q.waiters.push_back(id);
        Ticket {
            queues: self,
            key: key.to_owned(),
            id,
            wake: q.wake.clone(),
            seen: Cell::new(q.released),
        }
    }

    /// A guard of this `Locker` took `key`.
    pub(super) fn hold(&self, key: &str) {
        self.lock()
            .entry(key.to_owned())
            .or_insert_with(KeyQueue::new)
            .held = true;
    }

    /// A guard of this `Locker` released `key`.
    pub(crate) fn wake(&self, key: &str) {
        self.released.note(key, RELEASED_FOR);
        let mut map = self.lock();
        if let Some(q) = map.get_mut(key) {
            q.held = false;
            q.released += 1;
            if q.waiters.is_empty() {
                map.remove(key);
            } else {
                q.wake.notify_all();
            }
        }
    }

    /// Wakes the waiters for `key` without a release: a wait of theirs was cancelled.
    pub(super) fn interrupt(&self, key: &str) {
        if let Some(q) = self.lock().get(key) {
            q.wake.notify_all();
        }
    }

    /// The database says `key` was released, perhaps by another process (or, echoing a
    /// local release, by us: that changes nothing while a local guard holds it).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn wake_remote(&self, key: &str) {
        if let Some(q) = self.lock().get_mut(key) {
            q.released += 1;
            q.wake.notify_all();
        }
    }

    /// A release in another process granted `key` to a place of this `Locker`'s (its
    /// notification told what it gave): kept for the place's waiter (`take_grant`), which is
    /// woken as by `wake_remote`. Nothing if no thread here waits for the key.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn wake_granted(&self, key: &str, told: Told) {
        if let Some(q) = self.lock().get_mut(key) {
            if q.told.len() == TOLD_KEPT {
                q.told.pop_front();
            }
            q.told.push_back(told);
            q.released += 1;
            q.wake.notify_all();
        }
    }

    /// The grant told for place `place` taken with `holder`, if its notification came.
    pub(super) fn take_grant(&self, key: &str, place: i64, holder: &str) -> Option<Told> {
        let mut map = self.lock();
        let q = map.get_mut(key)?;
        let at = q
            .told
            .iter()
            .position(|t| t.place == place && t.holder == holder)?;
        q.told.remove(at)
    }

    /// Releases may have gone unheard: every waiter looks again.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(super) fn wake_all(&self) {
        for q in self.lock().values_mut() {
            q.released += 1;
            q.wake.notify_all();
        }
    }

    /// Notes that `key` was found held, or taken by a waiter in line.
    pub(super) fn mark_contended(&self, key: &str) {
        self.contended.note(key, CONTENDED_FOR);
    }

    /// The floor of `key`'s line seen lately (0: none known).
    pub(super) fn floor(&self, key: &str) -> i64 {
        let mut m = self.floors.lock().unpoisoned();
        match m.get_mut(key) {
            Some((floor, at)) if at.elapsed() < FLOOR_FOR => {
                *at = Instant::now();
                *floor
            }
            _ => 0,
        }
    }

    /// A look saw `floor` in `key`'s line.
    pub(super) fn raise_floor(&self, key: &str, floor: i64) {
        if floor <= 0 {
            return;
        }
        let mut m = self.floors.lock().unpoisoned();
        if m.len() >= 1024 && !m.contains_key(key) {
            m.retain(|_, (_, at)| at.elapsed() < FLOOR_FOR);
        }
        let e = m.entry(key.to_owned()).or_insert((0, Instant::now()));
        *e = (e.0.max(floor), Instant::now());
    }

    /// Whether a guard of this `Locker` released `key` within the last `RELEASED_FOR`.
    pub(super) fn released_lately(&self, key: &str) -> bool {
        self.released.lately(key, RELEASED_FOR)
    }

    /// Whether `key` was found contended within the last `CONTENDED_FOR`.
    pub(super) fn contended(&self, key: &str) -> bool {
        self.contended.lately(key, CONTENDED_FOR)
    }

    #[cfg(all(test, feature = "postgres"))]
    pub(super) fn has_waiters(&self) -> bool {
        self.lock().values().any(|q| !q.waiters.is_empty())
    }
}

/// A place in a key's line; dropping it leaves the line and wakes the next in it.
pub(super) struct Ticket<'a> {
    queues: &'a Queues,
    key: String,
    id: u64,
    wake: Arc<Condvar>,
    seen: Cell<u64>,
}

impl Ticket<'_> {
    /// Waits to be first in line. `None` if the deadline passed or the wait was cancelled
    /// first; otherwise whether anyone was ahead of us.
    pub(super) fn wait_turn(&self, deadline: Deadline, cancel: Option<&Cancel>) -> Option<bool> {
        let mut map = self.queues.lock();
        let mut queued = false;
        loop {
            // Checked under the map's lock, which a cancellation takes before it wakes us.
            if cancel.is_some_and(Cancel::is_cancelled) {
                return None;
            }
            let q = map.get(&self.key);
            if q.and_then(|q| q.waiters.front().copied()) == Some(self.id) {
                // Releases before our turn were for those ahead of us.
                self.seen.set(q.map_or(0, |q| q.released));
                return Some(queued);
            }
            queued = true;
            map = match deadline.remaining() {
                None => self.wake.wait(map).unpoisoned(),
                Some(left) if left.is_zero() => return None,
                Some(left) => self.wake.wait_timeout(map, left).unpoisoned().0,
            };
        }
    }

    /// Sleeps up to `pause`, or less if the key is released or the wait cancelled. While a
    /// guard of this `Locker` holds the key, sleeps up to `held` instead, and only its
    /// release (or a cancellation) ends that.
    pub(super) fn pause(&self, pause: Duration, held: Duration, cancel: Option<&Cancel>) {
        let start = Instant::now();
        let mut map = self.queues.lock();
        loop {
            if cancel.is_some_and(Cancel::is_cancelled) {
                break;
            }
            let Some(q) = map.get(&self.key) else { return };
            if !q.held && q.released != self.seen.get() {
                break;
            }
            let left = (if q.held { held } else { pause }).saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            map = self.wake.wait_timeout(map, left).unpoisoned().0;
        }
        if let Some(q) = map.get(&self.key) {
            self.seen.set(q.released);
        }
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut map = self.queues.lock();
        if let Some(q) = map.get_mut(&self.key) {
            q.waiters.retain(|&w| w != self.id);
            if q.waiters.is_empty() {
                if !q.held {
                    map.remove(&self.key);
                }
            } else {
                q.wake.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Queues, Told, TOLD_KEPT};

    fn told(place: i64, holder: &str) -> Told {
        Told {
            place,
            holder: holder.to_owned(),
            token: 7,
            acquired_us: 1,
        }
    }

    #[test]
    fn a_told_grant_is_taken_only_by_its_place_and_holder() {
        let q = Queues::default();
        let ticket = q.join("k");
        q.wake_granted("k", told(5, "aaaa"));
        // Another holder id at the same place (a key that only reads as a grant), another
        // place, another key: none of them is this grant.
        assert_eq!(q.take_grant("k", 5, "bbbb"), None);
        assert_eq!(q.take_grant("k", 6, "aaaa"), None);
        assert_eq!(q.take_grant("other", 5, "aaaa"), None);
        assert_eq!(q.take_grant("k", 5, "aaaa"), Some(told(5, "aaaa")));
        // Taken once.
        assert_eq!(q.take_grant("k", 5, "aaaa"), None);
        // The notification woke the waiter (`released` counted).
        assert!(ticket.seen.get() < q.lock()["k"].released);
    }

    #[test]
    fn grants_are_kept_only_while_a_thread_waits_and_only_the_last_few() {
        let q = Queues::default();
        q.wake_granted("k", told(1, "aaaa"));
        let _ticket = q.join("k");
        assert_eq!(
            q.take_grant("k", 1, "aaaa"),
            None,
            "kept with nobody waiting"
        );
        for place in 0..=i64::try_from(TOLD_KEPT).unwrap() {
            q.wake_granted("k", told(place, "aaaa"));
        }
        assert_eq!(q.take_grant("k", 0, "aaaa"), None, "the oldest is dropped");
        assert_eq!(q.take_grant("k", 1, "aaaa"), Some(told(1, "aaaa")));
    }
}
