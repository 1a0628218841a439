/**
 * shoal and llama-server side by side, up at the same time, request for request: issue 11's
 * aims where one server at a time cannot tell them apart from this VM's drift. bench-vs-llamacpp.ts
 * runs one server at a time, best of two runs a side, and a ratio near 1 (TTFT of a 128-token
 * prompt on 60m int4: 0.94–1.13 over a day's runs, with llama-server's own TTFT at 36–74 ms in
 * one run) moves with the minute each side happened to run in. Here both servers are started on
 * the same model, warmed, and then asked in pairs: the same fresh prompt to each, one right after
 * the other, the order alternating, so both sides of a pair see the same minute of the machine.
 * An idle server takes no CPU from the other (checked and printed: each one's CPU over an idle
 * second). Per model and metric it prints each side's median, the median of the pairs' ratios
 * (shoal ÷ llama-server) with a distribution-free 95 % interval, and in how many pairs shoal was
 * ahead.
 *
 * Metrics (token-id prompts, greedy, streamed; as bench-vs-llamacpp.ts asks them, so its figures
 * and these are the same measurements):
 *  - TTFT: a max_tokens-1 request on a fresh --prompt-token prompt (cold on both sides:
 *    llama-server without prompt cache, shoal with --kv-cache-mb 0), and on a --long one, read
 *    twice: to the response's end (the request's whole time) and to the token's chunk;
 *  - N streams (--stream-pairs > 0): --streams concurrent requests of --tokens tokens each, all
 *    tokens over the time from the first request to the last response's end, as
 *    bench-vs-llamacpp.ts times them; and the same run's p99 inter-token latency (over every
 *    stream's gaps between token chunks, a chunk of two tokens counted as two half gaps);
 *  - decode: one stream of --tokens tokens after a --prompt-token prompt, tok/s from its first
 *    token chunk to its last (the end-to-end figure of bench-vs-llamacpp.ts subtracts a TTFT
 *    measured apart; here each request's own first chunk stands for it).
 *
 *   node reproduction/paired-vs-llamacpp.ts [--sizes 60m,250m] [--quants int4 (or none,int4; none = fp32)] [--pairs 40]
 *     [--decode-pairs 12] [--long-pairs 6] [--stream-pairs 0] [--prompt 128] [--long 2000] [--tokens 128] [--warm-tokens 0] [--llama-dir DIR]
 *     [--temperature 0]   (every request samples at T over the whole vocabulary, seeded; 0: greedy)
 *     [--top-p 1]   (with --temperature: every request's top_p, the nucleus both servers cut to)
 *     [--streams 8]   (llama-server's slots: bench-vs-llamacpp.ts's server, sized for its concurrent streams)
 *     [--arms '{"llama-server":"llama","shoal":{}}']
 * Run it as bench-vs-llamacpp.ts is run (`chrt -r 10 node …` with nothing else on the machine):
 * both servers are spawned under the same realtime policy as this process.
 *
 * The same pairing tells two builds or settings of shoal apart (a change worth a few per cent,
 * which runs one server at a time cannot show here): `--arms` names two servers, the reference
 * first — "llama" for llama-server (`{"llama": ["--spec-type", "ngram-simple"]}`: with arguments
 * added), or a shoal arm as ab-serve-env.ts takes it: its environment's variables, or
 * `{"env": {…}, "dir": CHECKOUT, "shard": DIR, "args": ["--draft", "none"], "native": true}` (any
 * of them; `"native"` serves the model compiled for the benchmark kernels of
 * daemon/engine/native/ort-kernels.c, preloaded: true or "attention" the fused one-position
 * attention (wave 34), "int4" the int4 products as MatMulQ4 (q4-matmul.h, wave 35; what `shoal
 * serve` runs by default since wave 36, where it builds the kernel), "both").
 * Ratios are the second ÷ the first.
 */
import { mkdtemp, readFile, rm } from 'node:fs/promises'
import { availableParallelism, tmpdir, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { setTimeout as sleep } from 'node:timers/promises'
import { ensureModels } from './lib/bench-models.ts'
import type { ModelFiles } from './lib/bench-models.ts'
import { complete } from './lib/completions.ts'
import type { Completion } from './lib/completions.ts'
import { floorRank, gitDescribe, loadAverage, lscpuModel, median, medianInterval, promptIds } from './lib/index.ts'
import { ensureLlamaCpp, llamaServerArgs } from './lib/llamacpp.ts'
import { isLlama, parseArms, startArm } from './lib/arms.ts'
import type { Arm } from './lib/arms.ts'
import { rtPrefix, schedulingPolicy } from './lib/realtime.ts'
import { stop } from './lib/servers.ts'
import type { Server } from './lib/servers.ts'

const { values: args } = parseArgs({
  options: {
    'llama-dir': { type: 'string' },
    sizes: { type: 'string', default: '60m,250m' },
    quants: { type: 'string', default: 'int4' },
    pairs: { type: 'string', default: '40' },
    'decode-pairs': { type: 'string', default: '12' },
    'long-pairs': { type: 'string', default: '6' },
    'stream-pairs': { type: 'string', default: '0' },
    prompt: { type: 'string', default: '128' },
    long: { type: 'string', default: '2000' },
    tokens: { type: 'string', default: '128' },
    // More decode before anything is timed, on each server: a fresh shoal engine decodes faster
    // over its first few thousand tokens (docs/engine-notes.md, wave 25).
    'warm-tokens': { type: 'string', default: '0' },
    threads: { type: 'string', default: String(availableParallelism()) },
    // llama-server's slots (-np), as bench-vs-llamacpp.ts sizes it for its concurrent streams: the same server.
    streams: { type: 'string', default: '8' },
    arms: { type: 'string', default: '{"llama-server":"llama","shoal":{}}' },
    // Every request (warm-ups included) samples at this temperature over the whole vocabulary, as
    // bench-vs-llamacpp.ts's --temperature (lib/completions.ts: both servers' filters off); 0: greedy.
    temperature: { type: 'string', default: '0' },
    // With --temperature: the requests' top_p (both servers cut to the nucleus); 1: the whole vocabulary.
    'top-p': { type: 'string', default: '1' },
  },
})
const ARMS = parseArms(args.arms)
const PAIRS = Number(args.pairs)
const DECODE_PAIRS = Number(args['decode-pairs'])
const LONG_PAIRS = Number(args['long-pairs'])
const STREAM_PAIRS = Number(args['stream-pairs'])
const WARM_TOKENS = Number(args['warm-tokens'])
const STREAMS = Number(args.streams)
const PROMPT = Number(args.prompt)
const LONG = Number(args.long)
const TOKENS = Number(args.tokens)
const TEMPERATURE = Number(args.temperature)
if (!(TEMPERATURE >= 0)) throw new Error(`--temperature must be a number ≥ 0, not ${args.temperature}`)
const TOP_P = Number(args['top-p'])
if (!(TOP_P > 0 && TOP_P <= 1)) throw new Error(`--top-p must be in (0, 1], not ${args['top-p']}`)
const REPO = resolve(import.meta.dirname, '..')
const SHAPE = { threads: Number(args.threads), streams: STREAMS, prompt: PROMPT, tokens: TOKENS, long: LONG }
const log = (s: string): void => { process.stderr.write(`${s}\n`) }

/** One metric's pairs: the reference's value (`a`) and the other arm's (`b`) in each. */
interface Paired { name: string, unit: string, higherIsBetter: boolean, a: number[], b: number[] }

/** CPU time (ms) a process has used so far: utime + stime from /proc/PID/stat. */
async function cpuMs (pid: number): Promise<number> {
  const stat = await readFile(`/proc/${pid}/stat`, 'utf8')
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
  return (Number(fields[11]) + Number(fields[12])) * 10 // clock ticks of 10 ms (USER_HZ 100)
}

/** Each server's CPU over one idle second: what an idle server could take from the measured one. */
async function idleCpu (servers: Server[]): Promise<string> {
  const before = await Promise.all(servers.map(async s => await cpuMs(s.child.pid!)))
  await sleep(1000)
  const after = await Promise.all(servers.map(async s => await cpuMs(s.child.pid!)))
  return servers.map((s, i) => `${ARMS[i]![0]} ${after[i]! - before[i]!} ms`).join(', ')
}

/** Asks both servers the same thing, `a` first or `b` first; returns [a's, b's]. */
async function pair<T> (a: Server, b: Server, aFirst: boolean, ask: (s: Server) => Promise<T>): Promise<[T, T]> {
  if (aFirst) {
    const x = await ask(a)
    return [x, await ask(b)]
  }
  const y = await ask(b)
  return [await ask(a), y]
}

/**
 * STREAMS concurrent requests (fresh prompts from `salt` on): all their tokens a second, first
 * request sent to last response ended; and the p99 inter-token latency over every stream's gaps (a
 * user's view of the same run: the stalls, such as a step that waits for another request's
 * prefill). No p50: the client reads chunks in bursts on this 2-core VM, so half its gaps can be
 * ~0 on either side, and a pair's ratio of them means nothing.
 */
async function streams (s: Server, salt: number): Promise<{ tokS: number, itlP99: number }> {
  const t0 = performance.now()
  const all = await Promise.all(Array.from({ length: STREAMS }, async (_, i) => await complete(s, promptIds(PROMPT, salt + i), TOKENS, TEMPERATURE, TOP_P)))
  const gaps = all.flatMap(c => c.gaps)
  return { tokS: all.reduce((n, c) => n + c.count, 0) / ((Math.max(...all.map(c => c.end)) - t0) / 1000), itlP99: floorRank(gaps, 0.99) }
}

async function measure (m: ModelFiles, bin: string, cache: string): Promise<{ idle: string, metrics: Paired[] }> {
  const servers: Server[] = []
  try {
    // Each shoal its own data directory: two daemons cannot share one ledger.
    for (const [name, arm] of ARMS) servers.push(await startArm(arm, m, bin, SHAPE, join(cache, name)))
    const [a, b] = servers as [Server, Server]
    // Warm-up on each: the first run, JIT and thread pools, then requests shaped like the timed ones.
    // A fresh shoal decodes while idle after it listens (its settle, up to 3 s); its first request
    // here ends that, so nothing timed runs beside it.
    for (const s of servers) {
      await complete(s, promptIds(16, 999), 8, TEMPERATURE, TOP_P)
      await complete(s, promptIds(PROMPT, 998), TOKENS, TEMPERATURE, TOP_P)
      if (LONG > 0 && LONG_PAIRS > 0) await complete(s, promptIds(LONG, 997), 1, TEMPERATURE, TOP_P)
      if (STREAM_PAIRS > 0) await streams(s, 980)
      for (let left = WARM_TOKENS, i = 0; left > 0; left -= 512, i++) await complete(s, promptIds(PROMPT, 960 - i), Math.min(512, left), TEMPERATURE, TOP_P)
    }
    const idle = await idleCpu(servers)
    // Two readings of each max_tokens-1 request: its whole time (what every earlier wave reported),
    // and the time to its token's chunk, the usual meaning of TTFT. They differ by what each server
    // does after the token and before the response ends: llama-server's last chunk (~0.3 ms,
    // measured on 60m int4), shoal's last chunk and the receipt's signed, synced append (~1 ms),
    // which the response's end waits for (ARCHITECTURE.md: no acknowledged completion lacks its
    // receipt).
    const ttft: Paired = { name: `TTFT ${PROMPT}, request's end`, unit: 'ms', higherIsBetter: false, a: [], b: [] }
    const ttftFirst: Paired = { name: `TTFT ${PROMPT}, token's chunk`, unit: 'ms', higherIsBetter: false, a: [], b: [] }
    const long: Paired = { name: `TTFT ${LONG}, request's end`, unit: 'ms', higherIsBetter: false, a: [], b: [] }
    const longFirst: Paired = { name: `TTFT ${LONG}, token's chunk`, unit: 'ms', higherIsBetter: false, a: [], b: [] }
    const decode: Paired = { name: 'decode, 1 stream', unit: 'tok/s', higherIsBetter: true, a: [], b: [] }
    const many: Paired = { name: `${STREAMS} streams`, unit: 'tok/s', higherIsBetter: true, a: [], b: [] }
    const manyItl99: Paired = { name: `${STREAMS} streams, inter-token p99`, unit: 'ms', higherIsBetter: false, a: [], b: [] }
    const ms = (c: Completion): number => c.end - c.t0
    const firstMs = (c: Completion): number => c.first - c.t0
    const tokS = (c: Completion): number => (c.count - 1) / ((c.last - c.first) / 1000)
    const add = <T>(p: Paired, [x, y]: [T, T], f: (c: T) => number): void => { p.a.push(f(x)); p.b.push(f(y)) }
    /** One max_tokens-1 pair on a fresh `length`-token prompt, read both ways. */
    const ttftPair = async (toEnd: Paired, toToken: Paired, length: number, salt: number, aFirst: boolean): Promise<void> => {
      const p = await pair(a, b, aFirst, async s => await complete(s, promptIds(length, salt), 1, TEMPERATURE, TOP_P))
      add(toEnd, p, ms)
      add(toToken, p, firstMs)
    }
    // The metrics interleave (a decode pair after each TTFT pair, while they last): the machine's drift reaches all of them.
    const rounds = Math.max(PAIRS, DECODE_PAIRS, LONG_PAIRS, STREAM_PAIRS)
    for (let i = 0; i < rounds; i++) {
      const aFirst = i % 2 === 0
      if (i < PAIRS) await ttftPair(ttft, ttftFirst, PROMPT, 1000 + i, aFirst)
      if (i < DECODE_PAIRS) add(decode, await pair(a, b, !aFirst, async s => await complete(s, promptIds(PROMPT, 3000 + i), TOKENS, TEMPERATURE, TOP_P)), tokS)
      if (LONG > 0 && i < LONG_PAIRS) await ttftPair(long, longFirst, LONG, 5000 + i, aFirst)
      if (i < STREAM_PAIRS) {
        const p = await pair(a, b, !aFirst, async s => await streams(s, 7000 + i * STREAMS))
        add(many, p, x => x.tokS)
        add(manyItl99, p, x => x.itlP99)
      }
    }
    return { idle, metrics: [...(PAIRS > 0 ? [ttft, ttftFirst] : []), ...(LONG > 0 && LONG_PAIRS > 0 ? [long, longFirst] : []), ...(DECODE_PAIRS > 0 ? [decode] : []), ...(STREAM_PAIRS > 0 ? [many, manyItl99] : [])] }
  } finally {
    for (const s of servers) await stop(s)
  }
}

const f = (x: number, digits: number): string => Number.isFinite(x) ? x.toFixed(digits) : '–'

function row (m: ModelFiles, p: Paired): string {
  const ratios = p.b.map((x, i) => x / p.a[i]!)
  const [lo, hi] = medianInterval(ratios)
  const ahead = ratios.filter(r => p.higherIsBetter ? r > 1 : r < 1).length
  const digits = p.unit === 'ms' ? 1 : 0
  return `| ${m.modelId} | ${p.name} (${p.unit}) | ${ratios.length} | ${f(median(p.a), digits)} | ${f(median(p.b), digits)} | **${f(median(ratios), 3)}** | ${f(lo, 3)}–${f(hi, 3)} | ${ahead}/${ratios.length} |`
}

async function main (): Promise<void> {
  const began = Date.now()
  const models = await ensureModels(args.sizes, args.quants, log)
  const bin = ARMS.some(([, arm]) => isLlama(arm)) ? await ensureLlamaCpp(args['llama-dir']) : ''
  const loadStart = loadAverage(2)
  const cache = await mkdtemp(join(tmpdir(), 'shoal-paired-'))
  const rows: string[] = []
  const idles: string[] = []
  try {
    for (const m of models) {
      log(`${m.modelId}: starting both servers`)
      const { idle, metrics } = await measure(m, bin, cache)
      idles.push(`${m.modelId}: ${idle}`)
      for (const p of metrics) { rows.push(row(m, p)); log(rows.at(-1)!) }
    }
  } finally {
    await rm(cache, { recursive: true, force: true })
  }
  const rt = rtPrefix()
  console.log([
    `command: node reproduction/paired-vs-llamacpp.ts ${process.argv.slice(2).join(' ')}`,
    `machine: ${lscpuModel()}, ${availableParallelism()} CPUs, ${(totalmem() / 2 ** 30).toFixed(0)} GiB; Node ${process.version}; scheduling of this process: ${schedulingPolicy()}${rt.length > 0 ? `; servers under \`${rt.join(' ')}\`` : ''}`,
    `arms: ${ARMS.map(([name, arm]) => `${name} = ${JSON.stringify(arm)}`).join('; ')} (ratios: ${ARMS[1]![0]} ÷ ${ARMS[0]![0]})`,
    ...(bin === '' ? [] : [`llama.cpp: ${gitDescribe(resolve(bin, '..', '..'))}; llama-server ${llamaServerArgs('<gguf>', 0, SHAPE).join(' ')}`]),
    `shoal: \`shoal serve --model <shards> --device cpu --kv-cache-mb 0\`; git ${gitDescribe(REPO)}`,
    `requests: ${TEMPERATURE > 0 ? `sampled at temperature ${TEMPERATURE}, top_p ${TOP_P}${TOP_P < 1 ? '' : ' (the whole vocabulary)'}, seeded (llama-server also top_k 0, min_p 0, typical_p 1)` : 'greedy (temperature 0)'}, streamed, token-id prompts`,
    `pairs: the same fresh prompt to each server, one after the other, order alternating; ${PAIRS} TTFT pairs (${PROMPT}-token prompt, max_tokens 1), ${LONG_PAIRS} at ${LONG} tokens, ${DECODE_PAIRS} decode pairs (${PROMPT}-token prompt, ${TOKENS} tokens, first to last token chunk)${STREAM_PAIRS > 0 ? `, ${STREAM_PAIRS} pairs of ${STREAMS} concurrent streams (${TOKENS} tokens each, after an untimed round)` : ''}${WARM_TOKENS > 0 ? `; each server decoded ${WARM_TOKENS} more tokens before (--warm-tokens)` : ''}`,
    `idle CPU of each server over one second before the pairs: ${idles.join('; ')}`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}; total ${((Date.now() - began) / 1000).toFixed(0)} s`,
  ].map(l => `- ${l}`).join('\n'))
  console.log('')
  const [[ref], [other]] = ARMS as [[string, Arm], [string, Arm]]
  console.log(`| model | metric | pairs | ${ref} median | ${other} median | median of ${other} ÷ ${ref} | 95 % interval | ${other} ahead |`)
  console.log('|---|---|---:|---:|---:|---:|---:|---:|')
  for (const r of rows) console.log(r)
}

await main()
