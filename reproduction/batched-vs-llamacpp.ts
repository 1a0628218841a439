/**
 * The eight-stream workload at the engine level, without either server: llama.cpp's own
 * llama-batched-bench beside shoal's bare stage engine on the same weights, the same work — B
 * prompts of --prompt tokens prefilled, then --tokens steps of B rows — alternating, one at a
 * time. paired-vs-llamacpp.ts measures the served aims; this says how much of a served ratio is
 * the engines and how much the servers around them (issue 11's 8-stream aim, docs/engine-notes.md
 * wave 30).
 *
 * Each side as it serves:
 *  - llama.cpp: the B prompts as one batch (its -b 2048 / -ub 512, llama-server's defaults), then
 *    one token a sequence a step; one unified KV buffer with llama.cpp's default f16 cache and
 *    attention, as paired-vs-llamacpp.ts's server; no sampling. Each call first runs an untimed
 *    row of the largest B, as shoal's side is warmed (a fresh process's first row is cold: 60m
 *    Q4_0's one-row prefill 30 ms, against 19.5 ms after a row).
 *  - shoal: the stage engine `shoal serve` runs (its worker thread, the graphs graph-choice picks,
 *    the launcher's malloc tunables), in a child process of its own, the B prompts a run each as
 *    its batcher runs prefills, then one stepBatch of B rows a step, greedy in the graph, with
 *    run-ahead as the local service asks for it (RUN_AHEAD_STEPS): the worker feeds each step's
 *    tokens to the next without waiting for the main thread. Warmed first by --warm-steps decode
 *    steps (a fresh engine decodes slower over its first ~2,000: docs/engine-notes.md, wave 25);
 *    `shoal serve` warms itself less, so this is its steady state.
 *    Why a child: Node spawns with fork(), which write-protects every page of the spawning process;
 *    an engine in the process that spawned llama.cpp paid ~2,700 page faults (~30 ms, 60m int4)
 *    in its next prefill, rewriting them. `shoal serve` spawns nothing.
 *
 *   chrt -r 10 node reproduction/batched-vs-llamacpp.ts [--sizes 60m,250m] [--quants int4,none] [--batches 1,8]
 *     [--reps 5] [--prompt 128] [--tokens 128] [--warm-steps 2048] [--threads N] [--llama-dir DIR]
 * Prints per model and B each side's median prefill and decode seconds and tokens a second, and the
 * median of the reps' ratios (shoal's throughput ÷ llama.cpp's; > 1: shoal faster), each rep's
 * two sides run back to back, the order alternating.
 */
import { fork } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { once } from 'node:events'
import { setTimeout as sleep } from 'node:timers/promises'
import { availableParallelism, totalmem } from 'node:os'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { parseArgs } from 'node:util'
import { chooseStageGraphs, createStageEngine, GREEDY_PICK as GREEDY, resolveGraphChoice, RUN_AHEAD_STEPS, stageInfoOf } from '../daemon/engine/index.ts'
import type { TokenPick } from '../daemon/engine/index.ts'
import { loadManifest } from '../shards/index.ts'
import { ensureModels } from './lib/bench-models.ts'
import type { ModelFiles } from './lib/bench-models.ts'
import { batchTokenOf, gitDescribe, loadAverage, lscpuModel, median, promptIds } from './lib/index.ts'
import { ensureLlamaCpp, llamaBatchedBench, timedBatchedRows } from './lib/llamacpp.ts'
import { serveMallocEnv } from './lib/malloc.ts'
import { schedulingPolicy } from './lib/realtime.ts'

const { values: args } = parseArgs({
  options: {
    'llama-dir': { type: 'string' },
    sizes: { type: 'string', default: '60m,250m' },
    quants: { type: 'string', default: 'int4,none' },
    batches: { type: 'string', default: '1,8' },
    reps: { type: 'string', default: '5' },
    prompt: { type: 'string', default: '128' },
    tokens: { type: 'string', default: '128' },
    'warm-steps': { type: 'string', default: '2048' },
    threads: { type: 'string', default: String(availableParallelism()) },
    // Internal: this script as the engine's child process, on these shards.
    'engine-child': { type: 'string' },
  },
})
const BATCHES = args.batches.split(',').map(Number)
const REPS = Number(args.reps)
const PROMPT = Number(args.prompt)
const TOKENS = Number(args.tokens)
const THREADS = Number(args.threads)
const WARM_STEPS = Number(args['warm-steps'])
if (!BATCHES.every(b => Number.isInteger(b) && b >= 1) || !(REPS >= 1) || !(PROMPT >= 2) || !(TOKENS >= 2)) throw new Error('--batches (integers ≥ 1), --reps ≥ 1, --prompt ≥ 2, --tokens ≥ 2')
const REPO = resolve(import.meta.dirname, '..')
const log = (s: string): void => { process.stderr.write(`${s}\n`) }

/** One side's seconds for one B: the B prefills, then the decode steps. */
interface Timing { prefill: number, decode: number }

type Engine = ReturnType<typeof createStageEngine>

/** llama-batched-bench's workload on shoal's engine: B fresh prompts (from `salt`), then TOKENS steps of B rows. */
async function shoalRound (engine: Engine, b: number, salt: number): Promise<Timing> {
  const seqs = await Promise.all(Array.from({ length: b }, async () => await engine.open()))
  try {
    const t0 = performance.now()
    const first = await engine.stepBatch(seqs.map((seqId, i) => {
      const ids = promptIds(PROMPT, salt + i)
      return { seqId, input: { tokenIds: ids }, positions: ids.map((_, j) => j), pick: GREEDY }
    }))
    const t1 = performance.now()
    let tokens = first.map(batchTokenOf)
    // TOKENS decode steps, as llama-batched-bench's -ntg: each feeds a sequence's last token (the
    // prefill picked the first); the last step's pick is not used, as llama.cpp's last logits.
    for (let t = 0; t < TOKENS; t++) {
      const left = TOKENS - 1 - t
      const out = await engine.stepBatch(seqs.map((seqId, i) => ({
        seqId, input: { tokenIds: [tokens[i]!] }, positions: [PROMPT + t], pick: GREEDY,
        ...(left > 0 && RUN_AHEAD_STEPS > 0 ? { ahead: Array<TokenPick>(Math.min(left, RUN_AHEAD_STEPS)).fill(GREEDY) } : {}),
      })))
      tokens = out.map(batchTokenOf)
    }
    return { prefill: (t1 - t0) / 1000, decode: (performance.now() - t1) / 1000 }
  } finally {
    for (const s of seqs) await engine.free(s)
  }
}

interface Cell { b: number, llama: Timing[], shoal: Timing[] }

/** The engine's side of the child process: rounds on request, one at a time, until told to stop. */
async function engineChild (shards: string): Promise<void> {
  const manifest = await loadManifest(shards)
  const engine = createStageEngine({ ...resolveGraphChoice(shards, chooseStageGraphs(manifest, 0, 'CPU')), stage: stageInfoOf(manifest), backend: 'onnxruntime', device: 'CPU', threads: THREADS, maxSequences: Math.max(...BATCHES) })
  await engine.start()
  // Untimed: a fresh engine's first runs are slower (docs/engine-notes.md, wave 25).
  for (let steps = 0, i = 0; steps < WARM_STEPS || i < BATCHES.length; steps += TOKENS, i++) await shoalRound(engine, BATCHES[i % BATCHES.length]!, 50_000 + 100 * i)
  let queue = Promise.resolve()
  process.on('message', (msg: { b: number, salt: number } | 'stop') => {
    queue = queue.then(async () => {
      if (msg === 'stop') { await engine.stop(); process.disconnect(); return }
      process.send!(await shoalRound(engine, msg.b, msg.salt))
    }).catch((err: unknown) => { log(`engine child: ${err instanceof Error ? err.stack : String(err)}`); process.exit(1) })
  })
  process.send!('ready')
}

/** The child's next message (after sending `msg`, if any), or an error once `died` settles first. */
async function ask<T> (child: ChildProcess, died: Promise<never>, msg?: { b: number, salt: number } | 'stop'): Promise<T> {
  const reply = once(child, 'message') as Promise<[T]>
  if (msg !== undefined) child.send(msg)
  return (await Promise.race([reply, died]))[0]
}

async function measure (m: ModelFiles, tool: string): Promise<Cell[]> {
  // The engine child runs under `shoal serve`'s malloc tunables, chosen as its launcher chooses them.
  const env = serveMallocEnv() ?? process.env
  const child = fork(import.meta.filename, [...process.argv.slice(2), '--engine-child', m.shards], { env, stdio: ['ignore', 'inherit', 'inherit', 'ipc'] })
  const cells: Cell[] = BATCHES.map(b => ({ b, llama: [], shoal: [] }))
  // One watcher for the child's whole life (a listener a request would pile up); its rejection at
  // the expected exit below is read by nobody, hence the catch.
  const died = once(child, 'exit').then(([code, signal]) => { throw new Error(`engine child exited (${String(code ?? signal)})`) })
  died.catch(() => {})
  try {
    const ready = await ask<unknown>(child, died)
    if (ready !== 'ready') throw new Error(`engine child said ${JSON.stringify(ready)}`)
    for (let rep = 0; rep < REPS; rep++) {
      const llama = (): void => {
        // First an untimed row of the largest B: llama.cpp's first row in a fresh process is cold
        // (timedBatchedRows). Its rows come through a log thread that can lose (or repeat) the
        // last ones at exit: the tiny model's under a realtime policy always, a lone row often,
        // 60m's 1,8 not in 40 runs. A repeat is read once; a loss runs it again, with one more
        // row of the smallest B after the rest, whose loss costs nothing.
        for (let attempt = 1; ; attempt++) {
          const asked = [Math.max(...BATCHES), ...BATCHES, ...(attempt === 1 ? [] : [Math.min(...BATCHES)])]
          const rows = timedBatchedRows(llamaBatchedBench(tool, m.gguf, THREADS, PROMPT, TOKENS, asked, process.env))
          const found = cells.map(c => rows.find(x => x.pl === c.b))
          if (found.every(r => r !== undefined)) {
            cells.forEach((c, i) => c.llama.push({ prefill: found[i]!.tPp, decode: found[i]!.tTg }))
            return
          }
          if (attempt === 3) throw new Error(`llama-batched-bench printed rows for ${rows.map(x => x.pl).join(', ') || 'none'} of ${asked.join(', ')} sequences, three times`)
          log(`llama-batched-bench printed rows for ${rows.map(x => x.pl).join(', ') || 'none'} of ${BATCHES.join(', ')} sequences: again`)
        }
      }
      const shoal = async (): Promise<void> => { for (const c of cells) c.shoal.push(await ask<Timing>(child, died, { b: c.b, salt: 1000 * rep + 100 * c.b })) }
      if (rep % 2 === 0) { llama(); await shoal() } else { await shoal(); llama() }
      log(`${m.modelId} rep ${rep + 1}: ${cells.map(c => `B ${c.b} llama ${c.llama.at(-1)!.prefill.toFixed(3)}+${c.llama.at(-1)!.decode.toFixed(3)} s, shoal ${c.shoal.at(-1)!.prefill.toFixed(3)}+${c.shoal.at(-1)!.decode.toFixed(3)} s`).join('; ')}`)
    }
    child.send('stop')
    // Bounded: a child that does not stop is killed below.
    await Promise.race([died.catch(() => {}), sleep(30_000, undefined, { ref: false })])
  } finally {
    if (child.exitCode === null && child.signalCode === null) child.kill()
  }
  return cells
}

const f = (x: number, digits: number): string => x.toFixed(digits)

function rows (m: ModelFiles, c: Cell): string[] {
  const tok = (t: Timing): { pp: number, tg: number, all: number } => ({ pp: c.b * PROMPT / t.prefill, tg: c.b * TOKENS / t.decode, all: c.b * (PROMPT + TOKENS) / (t.prefill + t.decode) })
  const ls = c.llama.map(tok)
  const ss = c.shoal.map(tok)
  const line = (what: string, key: 'pp' | 'tg' | 'all'): string => {
    const ratios = ss.map((s, i) => s[key] / ls[i]![key])
    return `| ${m.modelId} | ${c.b} | ${what} | ${f(median(ls.map(x => x[key])), 0)} | ${f(median(ss.map(x => x[key])), 0)} | **${f(median(ratios), 3)}** | ${f(Math.min(...ratios), 3)}–${f(Math.max(...ratios), 3)} |`
  }
  return [line(`prefill (${c.b} × ${PROMPT})`, 'pp'), line(`decode (${TOKENS} steps)`, 'tg'), line('both', 'all')]
}

async function main (): Promise<void> {
  if (args['engine-child'] !== undefined) { await engineChild(args['engine-child']); return }
  const began = Date.now()
  const models = await ensureModels(args.sizes, args.quants, log)
  const bin = await ensureLlamaCpp(args['llama-dir'], ['llama-batched-bench'])
  const tool = join(bin, 'llama-batched-bench')
  const loadStart = loadAverage(2)
  const out: string[] = []
  for (const m of models) for (const c of await measure(m, tool)) out.push(...rows(m, c))
  console.log([
    `command: node reproduction/batched-vs-llamacpp.ts ${process.argv.slice(2).join(' ')}`,
    `machine: ${lscpuModel()}, ${availableParallelism()} CPUs, ${(totalmem() / 2 ** 30).toFixed(0)} GiB; Node ${process.version}; scheduling of this process: ${schedulingPolicy()}`,
    `llama.cpp: ${gitDescribe(resolve(bin, '..', '..'))}; llama-batched-bench -c <B·(prompt+tokens)> -b 2048 -ub 512 -npp ${PROMPT} -ntg ${TOKENS} -npl ${[Math.max(...BATCHES), ...BATCHES].join(',')} (its first row untimed, a warm-up) -t ${THREADS} -tb ${THREADS} --kv-unified -ngl 0`,
    `shoal: the bare stage engine in a child process (${THREADS} threads, run-ahead ${RUN_AHEAD_STEPS}, the launcher's malloc tunables), greedy, warmed by ${WARM_STEPS} decode steps; git ${gitDescribe(REPO)}`,
    `${REPS} reps a model, the two sides back to back, order alternating; each B's prompts fresh`,
    `load average (1/5/15 min): at start ${loadStart}; at end ${loadAverage(2)}; total ${((Date.now() - began) / 1000).toFixed(0)} s`,
  ].map(l => `- ${l}`).join('\n'))
  console.log('')
  console.log('| model | B | work | llama.cpp tok/s (median) | shoal tok/s (median) | median of shoal ÷ llama.cpp | range |')
  console.log('|---|---:|---|---:|---:|---:|---:|')
  for (const r of out) console.log(r)
}

await main()
