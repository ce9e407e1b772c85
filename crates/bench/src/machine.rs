//! The machine a figure was measured on, so that figures from different machines can be read
//! against each other: CPU model, cache sizes, transparent huge pages, the latency of a
//! dependent load over a table of a given size (pointer chasing), and hardware counters where
//! the kernel exposes a PMU (`perf_event_open`, hand-written: "unavailable" where it does not).

use serde::{Serialize, Serializer};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Instant;
use thiserror::Error;

/// What the machine says about itself; `None` where it does not say.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MachineInfo {
    pub cpu_model: Option<String>,
    pub cpus: usize,
    pub l2_bytes: Option<u64>,
    pub l3_bytes: Option<u64>,
    pub transparent_huge_pages: Option<String>,
}

impl MachineInfo {
    pub fn read() -> Self {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|v| v.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        });
        let cache = |i: u32| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()
                .and_then(|s| parse_size(&s))
        };
        Self {
            cpu_model,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            l2_bytes: cache(2),
            l3_bytes: cache(3),
            transparent_huge_pages: transparent_huge_pages(),
        }
    }

    /// One line: model, CPUs, L2, L3, THP.
    pub fn render(&self) -> String {
        let size = |b: Option<u64>| b.map_or("?".to_string(), format_bytes);
        format!(
            "{}, {} CPUs, L2 {}, L3 {}, THP {}",
            self.cpu_model.as_deref().unwrap_or("unknown CPU"),
            self.cpus,
            size(self.l2_bytes),
            size(self.l3_bytes),
            self.transparent_huge_pages.as_deref().unwrap_or("unknown"),
        )
    }
}

/// "512K", "32768K", "1M", "1024" (sysfs cache sizes) in bytes.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mul) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 1 << 10),
        b'M' | b'm' => (&s[..s.len() - 1], 1 << 20),
        b'G' | b'g' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok().map(|n| n * mul)
}

/// "256 KiB", "32 MiB", "1.5 GiB".
pub fn format_bytes(b: u64) -> String {
    let b = b as f64;
    let (v, unit) = if b >= (1u64 << 30) as f64 {
        (b / (1u64 << 30) as f64, "GiB")
    } else if b >= (1u64 << 20) as f64 {
        (b / (1u64 << 20) as f64, "MiB")
    } else if b >= 1024.0 {
        (b / 1024.0, "KiB")
    } else {
        (b, "B")
    };
    if v.fract() == 0.0 || v >= 100.0 {
        format!("{v:.0} {unit}")
    } else {
        format!("{v:.1} {unit}")
    }
}

#[derive(Debug, Error)]
pub enum MachineError {
    #[error("cannot map {bytes} bytes for the pointer chase: {source}")]
    Map {
        bytes: usize,
        source: std::io::Error,
    },
}

const LINE: usize = 64;
const WORDS_PER_LINE: usize = LINE / 8;
const HUGE_PAGE: usize = 2 << 20;

/// An anonymous mapping aligned to 2 MiB, advised for or against transparent huge pages.
struct Mapping {
    base: *mut libc::c_void,
    mapped: usize,
    start: *mut u64,
    words: usize,
}

impl Mapping {
    fn new(bytes: usize, huge: bool) -> Result<Self, MachineError> {
        let len = bytes.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        let mapped = len + HUGE_PAGE;
        // SAFETY: an anonymous private mapping; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(MachineError::Map {
                bytes,
                source: std::io::Error::last_os_error(),
            });
        }
        let offset = (HUGE_PAGE - (base as usize) % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: offset < HUGE_PAGE, inside the mapping.
        let start = unsafe { (base as *mut u8).add(offset) };
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // Advice only: a kernel without THP refuses it, and the chase still runs.
        // SAFETY: [start, start + len) lies inside the mapping.
        unsafe { libc::madvise(start as *mut libc::c_void, len, advice) };
        Ok(Self {
            base,
            mapped,
            start: start as *mut u64,
            words: len / 8,
        })
    }

    fn words(&mut self) -> &mut [u64] {
        // SAFETY: the mapping is readable, writable, zero-filled and lives as long as self.
        unsafe { std::slice::from_raw_parts_mut(self.start, self.words) }
    }

    /// Bytes of the mapping backed by huge pages (/proc/self/smaps), when readable.
    fn huge_bytes(&self) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let base = self.start as u64;
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = first.split_once('-') {
                if let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) {
                    inside = a <= base && base < b;
                    continue;
                }
            }
            if inside {
                if let Some(v) = line.strip_prefix("AnonHugePages:") {
                    return parse_size(v.trim().trim_end_matches("kB").trim()).map(|k| k * 1024);
                }
            }
        }
        None
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base, self.mapped) };
    }
}

/// One pointer-chase measurement.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Chase {
    pub bytes: u64,
    /// Asked for transparent huge pages (`MADV_HUGEPAGE`) or against them.
    pub huge: bool,
    /// Share of the buffer the kernel backed with huge pages (None: unknown).
    pub huge_backed: Option<f64>,
    /// Independent chains walked at once (1: latency; more: memory-level parallelism).
    pub chains: usize,
    pub loads: u64,
    /// Nanoseconds per load.
    pub ns: f64,
}

/// Latency of dependent loads over a `bytes` buffer: one `u64` "next" per 64-byte line, all
/// lines in one random cycle (Sattolo's algorithm, seeded), a warm lap, then `loads` timed
/// loads, walked by `chains` independent pointers spread over the cycle (1: each load waits
/// for the one before; 8: eight misses in flight).
pub fn chase(bytes: usize, huge: bool, chains: usize, loads: u64) -> Result<Chase, MachineError> {
    let lines = (bytes / LINE).max(2);
    let chains = chains.clamp(1, lines);
    let mut map = Mapping::new(lines * LINE, huge)?;
    let words = map.words();
    for i in 0..lines {
        words[i * WORDS_PER_LINE] = (i * WORDS_PER_LINE) as u64;
    }
    let mut rng = fastrand::Rng::with_seed(0x0063_6861_7365);
    for i in (1..lines).rev() {
        let j = rng.usize(0..i);
        words.swap(i * WORDS_PER_LINE, j * WORDS_PER_LINE);
    }
    // The warm lap walks the whole cycle and leaves the starts of the chains spread over it.
    let mut starts = Vec::with_capacity(chains);
    let mut p = 0usize;
    for step in 0..lines {
        if step % (lines / chains) == 0 && starts.len() < chains {
            starts.push(p);
        }
        p = words[p] as usize;
    }
    let per_chain = (loads / chains as u64).max(1);
    let t0 = Instant::now();
    let end = walk(words, &mut starts, per_chain);
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(end);
    let huge_backed = map
        .huge_bytes()
        .map(|h| (h as f64 / (lines * LINE) as f64).min(1.0));
    let loads = per_chain * chains as u64;
    Ok(Chase {
        bytes: (lines * LINE) as u64,
        huge,
        huge_backed,
        chains,
        loads,
        ns: secs * 1e9 / loads as f64,
    })
}

#[inline(never)]
fn walk(words: &[u64], ps: &mut [usize], steps: u64) -> usize {
    if let [p] = ps {
        let mut q = *p;
        for _ in 0..steps {
            // SAFETY: every stored value is the word offset of a line inside `words`.
            q = unsafe { *words.get_unchecked(q) } as usize;
        }
        *p = q;
        return q;
    }
    for _ in 0..steps {
        for p in ps.iter_mut() {
            // SAFETY: as above.
            *p = unsafe { *words.get_unchecked(*p) } as usize;
        }
    }
    ps.iter().fold(0, |a, p| a ^ p)
}

/// The calibration printed beside the figures: chase latencies at the sizes that matter.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub machine: MachineInfo,
    /// 256 KiB: inside L2.
    pub small: Chase,
    /// The size of the index's tables after the run, huge pages asked for (as the index's
    /// big tables do) and not.
    pub table_huge: Chase,
    pub table_small_pages: Chase,
    /// The index's table size, 8 chains at once.
    pub table_8_chains: Chase,
    /// Four times the L3 (64 MiB when the L3 is unknown), huge pages asked for and not.
    pub beyond_l3_huge: Chase,
    pub beyond_l3_small_pages: Chase,
    /// Huge pages asked for, 1 MiB to twice the L3 by doubling, a quarter of the loads each:
    /// where the latency steps up is the cache this process actually gets (a VM's share of
    /// the L3 can be far less than the size it reports).
    pub sweep: Vec<Chase>,
}

impl Calibration {
    /// Measures the chases (`loads` timed loads each; at least 10 M for a figure to keep).
    pub fn measure(table_bytes: usize, loads: u64) -> Result<Self, MachineError> {
        let machine = MachineInfo::read();
        let beyond = machine.l3_bytes.map_or(64 << 20, |l3| 4 * l3 as usize);
        let table = table_bytes.max(LINE * 2);
        let mut sweep = Vec::new();
        let mut size = 1usize << 20;
        while size <= beyond / 2 {
            sweep.push(chase(size, true, 1, (loads / 4).max(1))?);
            size *= 2;
        }
        Ok(Self {
            sweep,
            small: chase(256 << 10, false, 1, loads)?,
            table_huge: chase(table, true, 1, loads)?,
            table_small_pages: chase(table, false, 1, loads)?,
            table_8_chains: chase(table, true, 8, loads)?,
            beyond_l3_huge: chase(beyond, true, 1, loads)?,
            beyond_l3_small_pages: chase(beyond, false, 1, loads)?,
            machine,
        })
    }

    /// The table's size over the L3 (None when the L3 is unknown).
    pub fn table_over_l3(&self) -> Option<f64> {
        self.machine
            .l3_bytes
            .map(|l3| self.table_huge.bytes as f64 / l3 as f64)
    }

    /// Lines: the machine, then the chase latencies.
    pub fn render(&self) -> String {
        let c = |c: &Chase| {
            let backed = c
                .huge_backed
                .map_or(String::new(), |f| format!(" ({:.0}% huge)", f * 100.0));
            format!("{:.1}{backed}", c.ns)
        };
        let over = self
            .table_over_l3()
            .map_or(String::new(), |r| format!(" = {r:.2}x L3"));
        let sweep = self
            .sweep
            .iter()
            .map(|c| format!("{} {:.0}", format_bytes(c.bytes), c.ns))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "  machine    {}\n\
             \x20 chase ns   256 KiB {}; table {}{over}: {} THP, {} 4k, 8 chains {}; {} (4x L3): {} THP, {} 4k\n\
             \x20 sweep ns   {sweep} (THP)\n",
            self.machine.render(),
            c(&self.small),
            format_bytes(self.table_huge.bytes),
            c(&self.table_huge),
            c(&self.table_small_pages),
            c(&self.table_8_chains),
            format_bytes(self.beyond_l3_huge.bytes),
            c(&self.beyond_l3_huge),
            c(&self.beyond_l3_small_pages),
        )
    }
}

/// A hardware event counted with `perf_event_open`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PmuEvent {
    Cycles,
    Instructions,
    CacheMisses,
    /// Last-level cache read misses.
    LlcReadMisses,
    /// Data TLB read misses.
    DtlbReadMisses,
}

const PERF_TYPE_HARDWARE: u32 = 0;
const PERF_TYPE_HW_CACHE: u32 = 3;
const PERF_COUNT_HW_CACHE_LL: u64 = 2;
const PERF_COUNT_HW_CACHE_DTLB: u64 = 3;
const PERF_COUNT_HW_CACHE_OP_READ: u64 = 0;
const PERF_COUNT_HW_CACHE_RESULT_MISS: u64 = 1;
const PERF_EVENT_IOC_ENABLE: u64 = 0x2400;
const PERF_EVENT_IOC_DISABLE: u64 = 0x2401;
const PERF_EVENT_IOC_RESET: u64 = 0x2403;
const FLAG_DISABLED: u64 = 1 << 0;
const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;

impl PmuEvent {
    pub const ALL: [PmuEvent; 5] = [
        PmuEvent::Cycles,
        PmuEvent::Instructions,
        PmuEvent::CacheMisses,
        PmuEvent::LlcReadMisses,
        PmuEvent::DtlbReadMisses,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            PmuEvent::Cycles => "cycles",
            PmuEvent::Instructions => "instructions",
            PmuEvent::CacheMisses => "cache_misses",
            PmuEvent::LlcReadMisses => "llc_read_misses",
            PmuEvent::DtlbReadMisses => "dtlb_read_misses",
        }
    }

    /// perf_event_attr's `type` and `config`.
    const fn type_config(self) -> (u32, u64) {
        const fn cache(c: u64) -> u64 {
            c | (PERF_COUNT_HW_CACHE_OP_READ << 8) | (PERF_COUNT_HW_CACHE_RESULT_MISS << 16)
        }
        match self {
            PmuEvent::Cycles => (PERF_TYPE_HARDWARE, 0),
            PmuEvent::Instructions => (PERF_TYPE_HARDWARE, 1),
            PmuEvent::CacheMisses => (PERF_TYPE_HARDWARE, 3),
            PmuEvent::LlcReadMisses => (PERF_TYPE_HW_CACHE, cache(PERF_COUNT_HW_CACHE_LL)),
            PmuEvent::DtlbReadMisses => (PERF_TYPE_HW_CACHE, cache(PERF_COUNT_HW_CACHE_DTLB)),
        }
    }
}

/// `struct perf_event_attr` up to `sig_data` (PERF_ATTR_SIZE_VER7, 128 bytes); the bitfield
/// word is `flags`.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    type_: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
    branch_sample_type: u64,
    sample_regs_user: u64,
    sample_stack_user: u32,
    clockid: i32,
    sample_regs_intr: u64,
    aux_watermark: u32,
    sample_max_stack: u16,
    reserved_2: u16,
    aux_sample_size: u32,
    reserved_3: u32,
    sig_data: u64,
}

const _: () = assert!(std::mem::size_of::<PerfEventAttr>() == 128);

/// Why a counter could not be counted: the errno's name.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("unavailable ({errno})")]
pub struct Unavailable {
    pub errno: String,
}

impl Unavailable {
    fn last() -> Self {
        let e = std::io::Error::last_os_error();
        Self {
            errno: errno_name(e.raw_os_error().unwrap_or(0)),
        }
    }
}

fn errno_name(e: i32) -> String {
    match e {
        libc::ENOENT => "ENOENT",
        libc::EACCES => "EACCES",
        libc::EPERM => "EPERM",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EINVAL => "EINVAL",
        libc::ENODEV => "ENODEV",
        libc::ENOSYS => "ENOSYS",
        libc::EBUSY => "EBUSY",
        libc::EMFILE => "EMFILE",
        libc::E2BIG => "E2BIG",
        other => return format!("errno {other}"),
    }
    .to_string()
}

/// One counter of the calling thread, user space only.
struct Counter {
    fd: OwnedFd,
}

impl Counter {
    fn open(event: PmuEvent) -> Result<Self, Unavailable> {
        let (type_, config) = event.type_config();
        let attr = PerfEventAttr {
            type_,
            size: std::mem::size_of::<PerfEventAttr>() as u32,
            config,
            flags: FLAG_DISABLED | FLAG_EXCLUDE_KERNEL | FLAG_EXCLUDE_HV,
            ..Default::default()
        };
        // SAFETY: perf_event_open(attr, pid 0 = this thread, cpu -1 = any, no group, no
        // flags) reads `attr` only.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_perf_event_open,
                &attr as *const PerfEventAttr,
                0 as libc::pid_t,
                -1 as libc::c_int,
                -1 as libc::c_int,
                0 as libc::c_ulong,
            )
        };
        if fd < 0 {
            return Err(Unavailable::last());
        }
        // SAFETY: a new descriptor that nothing else owns.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(fd as i32) },
        })
    }

    fn ioctl(&self, request: u64) -> Result<(), Unavailable> {
        // SAFETY: a perf ioctl without argument on our descriptor.
        if unsafe { libc::ioctl(self.fd.as_raw_fd(), request as _, 0) } < 0 {
            return Err(Unavailable::last());
        }
        Ok(())
    }

    fn read(&self) -> Result<u64, Unavailable> {
        let mut v = 0u64;
        // SAFETY: reads at most 8 bytes into `v`.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n != 8 {
            return Err(Unavailable::last());
        }
        Ok(v)
    }
}

/// A count, or why there is none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PmuValue(pub Result<u64, Unavailable>);

impl Serialize for PmuValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match &self.0 {
            Ok(v) => s.serialize_u64(*v),
            Err(e) => s.serialize_str(&e.to_string()),
        }
    }
}

/// Counts of the hardware events over one stretch of the calling thread.
#[derive(Clone, Debug, Serialize)]
pub struct PmuReading {
    pub cycles: PmuValue,
    pub instructions: PmuValue,
    pub cache_misses: PmuValue,
    pub llc_read_misses: PmuValue,
    pub dtlb_read_misses: PmuValue,
}

impl PmuReading {
    fn get(&self, e: PmuEvent) -> &PmuValue {
        match e {
            PmuEvent::Cycles => &self.cycles,
            PmuEvent::Instructions => &self.instructions,
            PmuEvent::CacheMisses => &self.cache_misses,
            PmuEvent::LlcReadMisses => &self.llc_read_misses,
            PmuEvent::DtlbReadMisses => &self.dtlb_read_misses,
        }
    }

    /// Whether no counter counted (no PMU, or not allowed).
    pub fn unavailable(&self) -> Option<&Unavailable> {
        let mut first = None;
        for e in PmuEvent::ALL {
            match &self.get(e).0 {
                Ok(_) => return None,
                Err(u) => first = first.or(Some(u)),
            }
        }
        first
    }

    /// One line: every count divided by `per` (e.g. per block op), or why there are none.
    pub fn render_per(&self, per: f64, what: &str) -> String {
        if let Some(u) = self.unavailable() {
            return u.to_string();
        }
        PmuEvent::ALL
            .iter()
            .map(|&e| match &self.get(e).0 {
                Ok(v) => format!("{} {:.2}", e.name(), *v as f64 / per.max(1.0)),
                Err(u) => format!("{} {u}", e.name()),
            })
            .collect::<Vec<_>>()
            .join(", ")
            + &format!(" per {what}")
    }
}

/// The counters of the calling thread: open them, run the stretch to count, read them.
pub struct Pmu {
    counters: Vec<(PmuEvent, Result<Counter, Unavailable>)>,
}

impl Pmu {
    /// Opens every event (disabled); an event the kernel refuses reads as unavailable.
    pub fn open() -> Self {
        Self {
            counters: PmuEvent::ALL
                .iter()
                .map(|&e| (e, Counter::open(e)))
                .collect(),
        }
    }

    /// Counts the events over `f` on this thread.
    pub fn count<T>(&mut self, f: impl FnOnce() -> T) -> (T, PmuReading) {
        for (_, c) in &mut self.counters {
            if let Ok(k) = c {
                if let Err(u) = k
                    .ioctl(PERF_EVENT_IOC_RESET)
                    .and_then(|()| k.ioctl(PERF_EVENT_IOC_ENABLE))
                {
                    *c = Err(u);
                }
            }
        }
        let out = f();
        let mut values = Vec::with_capacity(self.counters.len());
        for (e, c) in &self.counters {
            let v = match c {
                Ok(k) => k.ioctl(PERF_EVENT_IOC_DISABLE).and_then(|()| k.read()),
                Err(u) => Err(u.clone()),
            };
            values.push((*e, PmuValue(v)));
        }
        let take = |e: PmuEvent| {
            values
                .iter()
                .find(|(k, _)| *k == e)
                .map(|(_, v)| v.clone())
                .expect("every event is read")
        };
        let reading = PmuReading {
            cycles: take(PmuEvent::Cycles),
            instructions: take(PmuEvent::Instructions),
            cache_misses: take(PmuEvent::CacheMisses),
            llc_read_misses: take(PmuEvent::LlcReadMisses),
            dtlb_read_misses: take(PmuEvent::DtlbReadMisses),
        };
        (out, reading)
    }
}

/// The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), when known.
pub fn transparent_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let start = s.find('[')? + 1;
    let end = s[start..].find(']')? + start;
    Some(s[start..end].to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!(parse_size("512K\n"), Some(512 << 10));
        assert_eq!(parse_size("32768K"), Some(32 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("64"), Some(64));
        assert_eq!(parse_size("x"), None);
        assert_eq!(format_bytes(256 << 10), "256 KiB");
        assert_eq!(format_bytes(3 << 19), "1.5 MiB");
        assert_eq!(format_bytes(128 << 20), "128 MiB");
    }

    #[test]
    fn the_chase_visits_every_line_once_per_lap() {
        // Rebuild the cycle as `chase` does and check it is one cycle over all lines.
        let lines = 1000;
        let mut map = Mapping::new(lines * LINE, false).unwrap();
        let words = map.words();
        for i in 0..lines {
            words[i * WORDS_PER_LINE] = (i * WORDS_PER_LINE) as u64;
        }
        let mut rng = fastrand::Rng::with_seed(7);
        for i in (1..lines).rev() {
            let j = rng.usize(0..i);
            words.swap(i * WORDS_PER_LINE, j * WORDS_PER_LINE);
        }
        let mut seen = vec![false; lines];
        let mut p = 0usize;
        for _ in 0..lines {
            assert!(
                !seen[p / WORDS_PER_LINE],
                "line {} seen twice",
                p / WORDS_PER_LINE
            );
            seen[p / WORDS_PER_LINE] = true;
            p = words[p] as usize;
        }
        assert_eq!(p, 0);
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn chases_measure_something() {
        for (huge, chains) in [(false, 1), (true, 1), (true, 8)] {
            let c = chase(1 << 20, huge, chains, 200_000).unwrap();
            assert_eq!(c.chains, chains);
            assert!(c.ns > 0.0 && c.ns.is_finite(), "{c:?}");
            assert!(c.loads >= 199_992);
        }
        let cal = Calibration::measure(1 << 16, 10_000).unwrap();
        assert!(cal.render().contains("chase ns"));
    }

    #[test]
    fn counters_count_or_say_why_not() {
        let mut pmu = Pmu::open();
        let (sum, reading) = pmu.count(|| (0..100_000u64).map(std::hint::black_box).sum::<u64>());
        assert_eq!(sum, 4_999_950_000);
        for e in PmuEvent::ALL {
            match &reading.get(e).0 {
                Ok(_) => {}
                Err(u) => assert!(!u.errno.is_empty()),
            }
        }
        // Instructions are counted wherever a PMU is: 100 k additions are more than 100 k.
        if let Ok(n) = reading.instructions.0 {
            assert!(n >= 100_000, "{n}");
        }
        let line = reading.render_per(1000.0, "op");
        assert!(
            line.contains("unavailable") || line.contains("per op"),
            "{line}"
        );
        let json = serde_json::to_value(&reading).unwrap();
        assert!(json["cycles"].is_u64() || json["cycles"].is_string());
        assert_eq!(errno_name(libc::ENOENT), "ENOENT");
        assert_eq!(errno_name(12345), "errno 12345");
    }
}
