//! Benchmark of the host side of free page reporting (not a test: nothing is
//! asserted about timing).
//!
//! Starts the daemon binary cargo built for this profile (`cargo bench` →
//! release), connects the hand-written frontend of `tests/common` with a
//! memfd as guest memory, and for every configuration (range size × ranges
//! per kick) repeatedly:
//!
//! 1. writes non-zero bytes to the ranges it will report (so there is
//!    something to discard),
//! 2. posts one reporting_vq chain with one device-writable descriptor per
//!    range (the Linux driver sends up to 32 per chain),
//! 3. kicks and waits (poll on the call eventfd) until the used ring shows
//!    the chain: report-to-ack latency; throughput = reported bytes / latency,
//! 4. checks that the memfd shrank by the reported bytes and reads the
//!    daemon's discard latency counters (`get_counters`) before and after.
//!
//! Every configuration is measured once per `--discard-threads` value (one
//! daemon each, default `0,1,2`): 0 is the synchronous path (ranges
//! discarded one after another on the vring thread), N > 0 a pool of N
//! discard workers that discard the ranges of one report in parallel.
//!
//! Repetitions are interleaved round-robin across configurations (the order
//! is rotated every round); one unrecorded warm-up round comes first.
//! Ranges are naturally aligned and, by default, separated by a gap of the
//! same size so the daemon cannot coalesce them (`--adjacent` lets it).
//!
//! Usage: `cargo bench --bench report_bench -- [--reps N] [--warmup N]
//! [--mem-mib N] [--adjacent] [--discard-threads 0,1,2] [--only 4MiBx32]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use vm_memory::{Bytes, GuestAddress};

const GIB: f64 = (1u64 << 30) as f64;
/// Ring size: room for a 32-descriptor chain.
const BENCH_QSIZE: u16 = 64;
/// Reported ranges start here (the first MiBs hold the rings).
const REPORT_BASE: u64 = GPA + 8 * MIB;

struct Opts {
    reps: usize,
    warmup: usize,
    mem_mib: u64,
    adjacent: bool,
    /// Daemon `--discard-threads` values to compare.
    threads: Vec<usize>,
    /// Only the configuration with this name (e.g. `4MiBx32`).
    only: Option<String>,
}

fn parse_args() -> Opts {
    let mut o = Opts {
        reps: 15,
        warmup: 1,
        mem_mib: 1024,
        adjacent: false,
        threads: vec![0, 1, 2],
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| usage(&format!("{name} needs a number")))
        };
        match a.as_str() {
            "--bench" => {} // passed by `cargo bench` to harness = false targets
            "--reps" => o.reps = num("--reps") as usize,
            "--warmup" => o.warmup = num("--warmup") as usize,
            "--mem-mib" => o.mem_mib = num("--mem-mib"),
            "--adjacent" => o.adjacent = true,
            "--discard-threads" => {
                let v = it.next().unwrap_or_default();
                o.threads = v
                    .split(',')
                    .map(|x| x.trim().parse().ok())
                    .collect::<Option<Vec<usize>>>()
                    .filter(|t| !t.is_empty())
                    .unwrap_or_else(|| usage("--discard-threads needs a list like 0,1,2"));
            }
            "--only" => o.only = it.next(),
            "-h" | "--help" => usage(""),
            _ => usage(&format!("unknown argument {a:?}")),
        }
    }
    if o.reps < 7 {
        usage("--reps must be at least 7 (median and quartiles need samples)");
    }
    o
}

fn usage(msg: &str) -> ! {
    if !msg.is_empty() {
        eprintln!("report_bench: {msg}");
    }
    eprintln!(
        "usage: cargo bench --bench report_bench -- [--reps N>=7] [--warmup N] \
         [--mem-mib N] [--adjacent] [--discard-threads N,N,..] [--only CONFIG]"
    );
    std::process::exit(if msg.is_empty() { 0 } else { 2 })
}

#[derive(Clone, Copy)]
struct Conf {
    /// Buddy order of one range (4 KiB pages): 9 = 2 MiB, 10 = 4 MiB.
    order: u32,
    /// Descriptors (ranges) per chain / per kick.
    batch: usize,
}

impl Conf {
    fn range(&self) -> u64 {
        4096 << self.order
    }
    fn bytes(&self) -> u64 {
        self.range() * self.batch as u64
    }
    fn name(&self) -> String {
        format!("{}MiBx{}", self.range() / MIB, self.batch)
    }
}

#[derive(Default)]
struct Samples {
    latency_us: Vec<f64>,
    gib_s: Vec<f64>,
    /// Daemon-side sum of discard call latencies per report, µs.
    daemon_us: Vec<f64>,
    /// Inflate kick -> used latency while a report is in flight, µs
    /// ([`probe_once`], configurations with 32 ranges only).
    probe_us: Vec<f64>,
    /// Daemon-side report -> ack latency (chain popped -> used element
    /// added), µs.
    ack_us: Vec<f64>,
    daemon_ops: u64,
    daemon_ns: u64,
    /// Reps where the memfd did not shrink by exactly the reported bytes.
    not_discarded: usize,
}

fn counter(c: &Value, k: &str) -> u64 {
    c["counters"][k]
        .as_u64()
        .unwrap_or_else(|| panic!("no counter {k}: {c}"))
}

/// Waits up to `timeout_ms` for the call eventfd; drains it if it fired.
fn wait_call(fd: &vmm_sys_util::eventfd::EventFd, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    if n == 1 && p.revents & libc::POLLIN != 0 {
        let _ = fd.read(); // readable: does not block
        true
    } else {
        false
    }
}

/// Touches, reports and times one chain of configuration `c`; records into `s`.
fn run_once(d: &Daemon, g: &mut Guest, c: Conf, stride: u64, fill: &[u8], s: &mut Samples) {
    let range = c.range();
    let descs: Vec<(u64, u32, bool)> = (0..c.batch as u64)
        .map(|i| (REPORT_BASE + i * stride, range as u32, true))
        .collect();
    for (gpa, _, _) in &descs {
        g.mem.write_slice(fill, GuestAddress(*gpa)).unwrap();
    }
    let before = control(d, r#"{"cmd":"get_counters"}"#);
    let blocks_before = g.blocks();
    let call = &g.calls[REPORTING];
    while wait_call(call, 0) {} // stale signals
    let q = &mut g.queues[REPORTING];
    q.push(&g.mem, &descs);
    let want = q.avail_idx;

    let t0 = Instant::now();
    g.kick(REPORTING);
    let q = &g.queues[REPORTING];
    while q.used_idx(&g.mem) != want {
        wait_call(call, 1000);
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "report never acknowledged"
        );
    }
    let lat = t0.elapsed();

    let freed = (blocks_before - g.blocks()) * 512;
    let after = control(d, r#"{"cmd":"get_counters"}"#);
    let ops = counter(&after, "discard_ops") - counter(&before, "discard_ops");
    let ns = counter(&after, "discard_ns_sum") - counter(&before, "discard_ns_sum");
    let discarded = counter(&after, "discarded_bytes") - counter(&before, "discarded_bytes");
    let ack_ns = counter(&after, "report_ack_ns_sum") - counter(&before, "report_ack_ns_sum");
    if freed != c.bytes() || discarded != c.bytes() {
        s.not_discarded += 1;
        eprintln!(
            "warning: {}: reported {} B, memfd shrank {freed} B, daemon discarded {discarded} B",
            c.name(),
            c.bytes()
        );
    }
    let secs = lat.as_secs_f64();
    s.latency_us.push(secs * 1e6);
    s.gib_s.push(c.bytes() as f64 / GIB / secs);
    s.daemon_us.push(ns as f64 / 1e3);
    s.ack_us.push(ack_ns as f64 / 1e3);
    s.daemon_ops += ops;
    s.daemon_ns += ns;
}

/// Probe: while a report of `c` is in flight (2 ms after its kick), one
/// inflate chain (1 PFN + bit 7 bitmap) is kicked; returns its kick -> used
/// latency in µs. With discards on the vring thread the inflate waits for
/// the rest of the report.
fn probe_once(g: &mut Guest, c: Conf, stride: u64, fill: &[u8]) -> f64 {
    let descs: Vec<(u64, u32, bool)> = (0..c.batch as u64)
        .map(|i| (REPORT_BASE + i * stride, c.range() as u32, true))
        .collect();
    for (gpa, _, _) in &descs {
        g.mem.write_slice(fill, GuestAddress(*gpa)).unwrap();
    }
    let (pfns, bitmap, page) = (GPA + 2 * MIB, GPA + 2 * MIB + 0x800, GPA + 4 * MIB);
    g.mem
        .write_slice(&((page >> 12) as u32).to_le_bytes(), GuestAddress(pfns))
        .unwrap();
    g.fill(page, 4096, 0x5a);
    for q in [REPORTING, INFLATE] {
        while wait_call(&g.calls[q], 0) {}
    }
    g.queues[REPORTING].push(&g.mem, &descs);
    let want_rep = g.queues[REPORTING].avail_idx;
    g.queues[INFLATE].push(&g.mem, &[(pfns, 4, false), (bitmap, 1, true)]);
    let want_inf = g.queues[INFLATE].avail_idx;
    g.kick(REPORTING);
    std::thread::sleep(Duration::from_millis(2));
    let t1 = Instant::now();
    g.kick(INFLATE);
    while g.queues[INFLATE].used_idx(&g.mem) != want_inf {
        wait_call(&g.calls[INFLATE], 1000);
        assert!(
            t1.elapsed() < Duration::from_secs(10),
            "inflate never acked"
        );
    }
    let lat = t1.elapsed().as_secs_f64() * 1e6;
    while g.queues[REPORTING].used_idx(&g.mem) != want_rep {
        wait_call(&g.calls[REPORTING], 1000);
        assert!(t1.elapsed() < Duration::from_secs(10), "report never acked");
    }
    lat
}

/// Percentile with linear interpolation between closest ranks.
fn pct(sorted: &[f64], p: f64) -> f64 {
    let x = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (x - lo as f64)
}

struct Summary {
    median: f64,
    p25: f64,
    p75: f64,
    min: f64,
    max: f64,
}

fn summary(v: &[f64]) -> Summary {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Summary {
        median: pct(&s, 50.0),
        p25: pct(&s, 25.0),
        p75: pct(&s, 75.0),
        min: s[0],
        max: s[s.len() - 1],
    }
}

/// Rounds to 3 decimals for the JSON lines.
fn r3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn read_trim(p: &str) -> String {
    std::fs::read_to_string(p)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

/// One daemon (`--discard-threads threads`): warm-up and measured rounds
/// over `confs`; returns the samples (indexed like `confs`) and the daemon's
/// counters at the end.
fn run_daemon(o: &Opts, confs: &[Conf], threads: usize, fill: &[u8]) -> (Vec<Samples>, Value) {
    let t = threads.to_string();
    let d = start_daemon_with(
        &format!("bench-t{threads}"),
        &["--log-level", "warn", "--discard-threads", &t],
    );
    let mut g = Guest::connect_with(&d, None, o.mem_mib * MIB, BENCH_QSIZE);
    println!("  daemon:  {}", d.cmdline);
    let mut samples: Vec<Samples> = confs.iter().map(|_| Samples::default()).collect();
    let mut scratch = Samples::default();
    for round in 0..o.warmup + o.reps {
        for k in 0..confs.len() {
            let i = (k + round) % confs.len();
            let c = confs[i];
            let stride = if o.adjacent { c.range() } else { 2 * c.range() };
            let s = if round < o.warmup {
                &mut scratch
            } else {
                &mut samples[i]
            };
            run_once(&d, &mut g, c, stride, &fill[..c.range() as usize], s);
        }
    }
    for _ in 0..o.reps {
        for (c, s) in confs.iter().zip(samples.iter_mut()) {
            if c.batch > 1 {
                let stride = if o.adjacent { c.range() } else { 2 * c.range() };
                let v = probe_once(&mut g, *c, stride, &fill[..c.range() as usize]);
                s.probe_us.push(v);
            }
        }
    }
    let end = control(&d, r#"{"cmd":"get_counters"}"#);
    (samples, end)
}

fn main() {
    let o = parse_args();
    let all = [
        Conf { order: 9, batch: 1 },
        Conf {
            order: 9,
            batch: 32,
        },
        Conf {
            order: 10,
            batch: 1,
        },
        Conf {
            order: 10,
            batch: 32,
        },
    ];
    let confs: Vec<Conf> = all
        .iter()
        .copied()
        .filter(|c| o.only.as_ref().is_none_or(|n| *n == c.name()))
        .collect();
    if confs.is_empty() {
        usage("--only: no such configuration (1MiB.. see the table names)");
    }
    let mem = o.mem_mib * MIB;
    let max_range = confs.iter().map(Conf::range).max().unwrap();
    let max_batch = confs.iter().map(|c| c.batch).max().unwrap() as u64;
    let span = max_range * max_batch * if o.adjacent { 1 } else { 2 };
    if REPORT_BASE + span > GPA + mem {
        usage(&format!(
            "--mem-mib {} too small: need {} MiB",
            o.mem_mib,
            (REPORT_BASE + span - GPA) / MIB
        ));
    }

    println!("report_bench: host side of free page reporting (vhost-user-balloon)");
    println!(
        "  bench:   {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    println!(
        "  host:    kernel {}, {} CPUs, loadavg at start {}, shmem THP {}",
        read_trim("/proc/sys/kernel/osrelease"),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        read_trim("/proc/loadavg"),
        read_trim("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
    );
    println!(
        "  guest:   {} MiB memfd, {}-entry rings, ranges naturally aligned, {}",
        o.mem_mib,
        BENCH_QSIZE,
        if o.adjacent {
            "adjacent (daemon coalesces them)"
        } else {
            "one range-sized gap between ranges (no coalescing: one discard call each)"
        }
    );
    println!(
        "  method:  {} reps/config after {} warm-up round(s), round-robin, one daemon per \
         --discard-threads value ({}; 0 = synchronous on the vring thread); latency = kick -> \
         used ring shows the chain (poll on call eventfd)",
        o.reps,
        o.warmup,
        o.threads
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );

    let fill = vec![0x5au8; max_range as usize];
    let runs: Vec<(usize, Vec<Samples>, Value)> = o
        .threads
        .iter()
        .map(|&t| {
            let (s, end) = run_daemon(&o, &confs, t, &fill);
            (t, s, end)
        })
        .collect();

    println!();
    println!(
        "{:>7} {:<8} {:>4} | {:>34} | {:>30} | {:>20} | {:>22}",
        "threads",
        "config",
        "reps",
        "report->ack latency, us",
        "throughput, GiB/s",
        "daemon, us",
        "inflate during report"
    );
    println!(
        "{:>7} {:<8} {:>4} | {:>7} {:>26} | {:>6} {:>23} | {:>9} {:>10} | {:>22}",
        "",
        "",
        "",
        "median",
        "p25-p75 [min-max]",
        "median",
        "p25-p75 [min-max]",
        "pop->ack",
        "/discard",
        "us, median [min-max]"
    );
    let mut lines = Vec::new();
    for (threads, samples, _) in &runs {
        for (c, s) in confs.iter().zip(samples) {
            let l = summary(&s.latency_us);
            let t = summary(&s.gib_s);
            let dm = summary(&s.daemon_us);
            let ack = summary(&s.ack_us);
            let per_op_us = s.daemon_ns as f64 / 1e3 / s.daemon_ops.max(1) as f64;
            let probe = (!s.probe_us.is_empty()).then(|| summary(&s.probe_us));
            println!(
                "{:>7} {:<8} {:>4} | {:>7.0} {:>26} | {:>6.2} {:>23} | {:>9.0} {:>10.0} | {:>22}",
                threads,
                c.name(),
                s.latency_us.len(),
                l.median,
                format!("{:.0}-{:.0} [{:.0}-{:.0}]", l.p25, l.p75, l.min, l.max),
                t.median,
                format!("{:.2}-{:.2} [{:.2}-{:.2}]", t.p25, t.p75, t.min, t.max),
                ack.median,
                per_op_us,
                probe.as_ref().map_or("-".into(), |p| format!(
                    "{:.0} [{:.0}-{:.0}]",
                    p.median, p.min, p.max
                )),
            );
            lines.push(json!({
                "bench": "report_bench",
                "discard_threads": threads,
                "config": c.name(),
                "range_bytes": c.range(),
                "range_order": c.order,
                "ranges_per_kick": c.batch,
                "bytes_per_report": c.bytes(),
                "adjacent": o.adjacent,
                "reps": s.latency_us.len(),
                "latency_us_median": r3(l.median),
                "latency_us_p25": r3(l.p25),
                "latency_us_p75": r3(l.p75),
                "latency_us_min": r3(l.min),
                "latency_us_max": r3(l.max),
                "throughput_gib_per_s_median": r3(t.median),
                "throughput_gib_per_s_p25": r3(t.p25),
                "throughput_gib_per_s_p75": r3(t.p75),
                "throughput_gib_per_s_min": r3(t.min),
                "throughput_gib_per_s_max": r3(t.max),
                "daemon_pop_to_ack_us_median": r3(ack.median),
                "daemon_discard_us_per_report_median": r3(dm.median),
                "daemon_discard_us_per_call_mean": r3(per_op_us),
                "daemon_discard_calls": s.daemon_ops,
                "reps_not_fully_discarded": s.not_discarded,
                "inflate_during_report_us_median": probe.as_ref().map(|p| r3(p.median)),
                "inflate_during_report_us_min": probe.as_ref().map(|p| r3(p.min)),
                "inflate_during_report_us_max": probe.as_ref().map(|p| r3(p.max)),
            }));
        }
    }
    println!(
        "(pop->ack: the daemon's report_ack_ns_sum per report, median: chain popped -> used \
         element added; /discard: mean latency of one discard call; inflate during report: \
         kick -> used of a 1-PFN inflate kicked 2 ms after a report, separate rounds)"
    );
    println!();
    for (threads, _, end) in &runs {
        println!(
            "daemon --discard-threads {threads} totals (incl. warm-up): reports {}, acks {}, \
             discarded {} MiB, discard calls {}, discard_ns_max {} ns, report_ack_ns_max {} ns, \
             discard_errors {}",
            counter(end, "reports"),
            counter(end, "report_acks"),
            counter(end, "discarded_bytes") / MIB,
            counter(end, "discard_ops"),
            counter(end, "discard_ns_max"),
            counter(end, "report_ack_ns_max"),
            counter(end, "discard_errors"),
        );
    }
    println!("loadavg at end {}", read_trim("/proc/loadavg"));
    println!();
    for l in lines {
        println!("{l}");
    }
}
