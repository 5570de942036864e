//! Discard worker pool: free page reports are treated (discarded, filled)
//! off the vring thread, so that one report does not hold up the inflate,
//! deflate and stats queues served by the same thread, and the ranges of one
//! report are discarded in parallel.
//!
//! The pool only runs tasks and counts in-flight work; what a task does and
//! when a report is acknowledged is up to the backend (`backend.rs`).
//!
//! # In-flight work
//!
//! Every report popped from reporting_vq holds an [`InFlight`] token until
//! its used element was added (or dropped, see below), and so does the vring
//! thread while it handles an event (so a chain popped but not yet queued
//! is not missed). [`DiscardPool::quiesce`]
//! blocks until no token is left. The backend calls it from the frontend
//! request thread before it lets a message change what a worker could touch:
//!
//! * GET_VRING_BASE (`stop_vring`): the reports popped so far are completed
//!   (their used elements are in the ring) before the frontend reads the ring
//!   state back;
//! * SET_MEM_TABLE and the other memory table updates (`update_memory`): a
//!   task treats ranges through the `Arc` of the memory map that was current
//!   when its chain was popped, so an old map stays mapped until its tasks are
//!   done, and the message is answered only after that;
//! * SET_FEATURES (`acked_features`) and RESET_DEVICE (`reset_device`): no
//!   report of the old driver instance is in flight afterwards;
//! * the end of a connection (`BalloonBackend::quiesce` in `server.rs`): the
//!   next frontend is accepted only when every discard of the last one is done.
//!
//! A completion adds its used element only while the vring is enabled (the
//! library disables every vring before it calls `reset_device`); otherwise it
//! is dropped: the guest never sees an acknowledgement for a range whose
//! discard it cannot wait for, and no ack is ever written before the discard
//! it acknowledges is done.
//!
//! With `threads == 0` there is no worker: tasks run inline on the calling
//! (vring) thread, which is the old synchronous behaviour.

use std::collections::VecDeque;
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};

use log::error;
use thiserror::Error;

/// Upper bound of `--discard-threads`.
pub const MAX_DISCARD_THREADS: usize = 64;

/// Error of this module.
#[derive(Debug, Error)]
pub enum PoolError {
    /// Starting a worker thread failed.
    #[error("cannot start discard worker {index}: {source}")]
    Spawn {
        /// worker number
        index: usize,
        /// cause
        source: io::Error,
    },
}

/// A unit of work for a worker.
pub type Task = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct State {
    tasks: VecDeque<Task>,
    in_flight: usize,
    shutdown: bool,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// A task was queued, or shutdown.
    work: Condvar,
    /// `in_flight` dropped to 0.
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Tasks run outside the lock; a poisoned lock still holds a
        // consistent queue and counter.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Marks one report as in flight until dropped.
pub struct InFlight {
    shared: Arc<Shared>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut s = self.shared.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 {
            self.shared.idle.notify_all();
        }
    }
}

/// A fixed set of worker threads taking tasks from one FIFO queue.
pub struct DiscardPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

fn worker(shared: &Shared) {
    loop {
        let task = {
            let mut s = shared.lock();
            loop {
                if let Some(t) = s.tasks.pop_front() {
                    break t;
                }
                if s.shutdown {
                    return;
                }
                s = shared.work.wait(s).unwrap_or_else(|p| p.into_inner());
            }
        };
        run(task);
    }
}

fn run(task: Task) {
    // A panicking task drops its report (and so its in-flight token)
    // without acknowledging it; the worker lives on.
    if catch_unwind(AssertUnwindSafe(task)).is_err() {
        error!("discard task panicked; its report is not acknowledged");
    }
}

impl DiscardPool {
    /// Starts `threads` workers (0: tasks run inline in [`Self::spawn`]).
    pub fn new(threads: usize) -> Result<Self, PoolError> {
        let shared = Arc::new(Shared::default());
        let mut pool = Self {
            shared,
            workers: Vec::with_capacity(threads),
        };
        for index in 0..threads {
            let s = pool.shared.clone();
            let h = thread::Builder::new()
                .name(format!("discard-{index}"))
                .spawn(move || worker(&s))
                .map_err(|source| PoolError::Spawn { index, source })?;
            pool.workers.push(h);
        }
        Ok(pool)
    }

    /// A pool without workers: tasks run inline.
    pub fn empty() -> Self {
        Self {
            shared: Arc::new(Shared::default()),
            workers: Vec::new(),
        }
    }

    /// Number of worker threads (0: inline).
    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    /// Registers one in-flight report; it ends when the token is dropped.
    pub fn begin(&self) -> InFlight {
        self.shared.lock().in_flight += 1;
        InFlight {
            shared: self.shared.clone(),
        }
    }

    /// Reports in flight now.
    pub fn in_flight(&self) -> usize {
        self.shared.lock().in_flight
    }

    /// Queues `task` for a worker, or runs it now without workers.
    pub fn spawn(&self, task: Task) {
        if self.workers.is_empty() {
            run(task);
            return;
        }
        self.shared.lock().tasks.push_back(task);
        self.shared.work.notify_one();
    }

    /// Blocks until no report is in flight. Must not be called from a
    /// worker (a task waiting for itself would never return).
    pub fn quiesce(&self) {
        let mut s = self.shared.lock();
        while s.in_flight > 0 {
            s = self.shared.idle.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for DiscardPool {
    /// Lets the workers finish the queued tasks, then joins them.
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for h in self.workers.drain(..) {
            if h.join().is_err() {
                error!("discard worker panicked");
            }
        }
    }
}

/// The default worker count: 2, or 1 on a single CPU.
pub fn default_threads() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get().min(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn inline_pool_runs_tasks_on_the_caller() {
        let p = DiscardPool::new(0).unwrap();
        let me = thread::current().id();
        let (tx, rx) = mpsc::channel();
        p.spawn(Box::new(move || tx.send(thread::current().id()).unwrap()));
        assert_eq!(rx.try_recv().unwrap(), me);
        assert_eq!(p.threads(), 0);
    }

    #[test]
    fn quiesce_waits_for_in_flight_tokens() {
        let p = DiscardPool::new(2).unwrap();
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..8 {
            let tok = p.begin();
            let d = done.clone();
            p.spawn(Box::new(move || {
                thread::sleep(Duration::from_millis(20));
                d.fetch_add(1, Ordering::SeqCst);
                drop(tok);
            }));
        }
        p.quiesce();
        assert_eq!(done.load(Ordering::SeqCst), 8);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn a_panicking_task_releases_its_token_and_the_worker_survives() {
        let p = DiscardPool::new(1).unwrap();
        let tok = p.begin();
        p.spawn(Box::new(move || {
            let _t = tok;
            panic!("test panic");
        }));
        p.quiesce();
        let (tx, rx) = mpsc::channel();
        p.spawn(Box::new(move || tx.send(()).unwrap()));
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }
}
