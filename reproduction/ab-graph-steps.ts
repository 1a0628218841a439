/**
 * Two compiled shards' decode steps side by side in one process (issue 11; docs/engine-notes.md,
 * wave 27): a change to the stage graph worth a few per cent of a step, which processes timed one
 * after another cannot show on these VMs (the same graph in two processes a minute apart: ±20 %),
 * shows here to about ±1 %. Both sessions are made as the engine makes them (graph optimisation
 * 'all', sequential, intra-op threads spinning only within a run) and run the same one-position
 * step — B rows at context C over a past buffer as wide as the engine's block for it
 * (kv-block.ts `blockCapacity`; zeros past each row's live columns), greedy_token and
 * new_key_values fetched as the engine fetches them — alternately, A B A B …; each pair's ratio
 * B ÷ A is kept. The session run second in a pair comes out ~2 % faster with two copies of the
 * same shard, so every cell runs twice, in two processes, once each way round, and the two
 * medians' geometric mean is the figure (the same shard twice: 0.999). Bits: each cell also says
 * whether both graphs gave the same greedy tokens and the same new KV columns.
 *
 *   node reproduction/ab-graph-steps.ts --a SHARD_DIR --b SHARD_DIR [--contexts 16,192] [--rows 1,8] [--runs 1000]
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine). Single-stage
 * shards of the 'ort-contrib' op set (an embedding and a head: what `shoal shard` writes by default).
 */
import { execFileSync } from 'node:child_process'
import { join, resolve } from 'node:path'
import { performance } from 'node:perf_hooks'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { sessionOptions } from '../daemon/engine/backend/onnxruntime.ts'
import { blockCapacity } from '../daemon/engine/kv-block.ts'
import { ATTENTION_MASK, GREEDY_TOKEN, INPUT_IDS, NEW_KV, NUM_LOGITS_TO_KEEP, POSITION_IDS, pastKeyName, pastValueName } from '../shards/contract.ts'
import { loadManifest } from '../shards/index.ts'
import { gitDescribe, loadAverage, lscpuModel, median } from './lib/index.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

const { values: args } = parseArgs({
  options: {
    a: { type: 'string' },
    b: { type: 'string' },
    contexts: { type: 'string', default: '16,192' },
    rows: { type: 'string', default: '1,8' },
    runs: { type: 'string', default: '1000' },
    cell: { type: 'string' },
  },
})
const RUNS = Number(args.runs)

interface Cell { first: string, second: string, context: number, rows: number }
interface CellResult { firstMs: number, secondMs: number, ratio: number, sameTokens: boolean, sameKv: boolean }

/** A stage-0 session of `dir`, as the engine's backend makes one (daemon/engine/backend/onnxruntime.ts). */
async function open (dir: string): Promise<{ session: ort.InferenceSession, layers: number, kvH: number, hd: number, maxPositions: number }> {
  const m = await loadManifest(dir)
  const stage = m.stages[0]!
  if (m.stages.length !== 1 || !stage.hasEmbedding || !stage.hasHead || m.opSet !== 'ort-contrib') throw new Error(`${dir}: a single-stage 'ort-contrib' shard is needed`)
  const session = await ort.InferenceSession.create(join(dir, stage.graph), sessionOptions({ threads: 2 }))
  for (const name of [GREEDY_TOKEN, NEW_KV]) if (!session.outputNames.includes(name)) throw new Error(`${dir}: its graph has no ${name} output (compiler ≥ 10 writes it)`)
  return { session, layers: m.shape.numLayers, kvH: m.shape.numKvHeads, hd: m.shape.headDim, maxPositions: m.shape.maxPositions }
}

/** One cell in this process: `first` and `second` alternating, `second` run second in each pair. */
async function timeCell ({ first, second, context: C, rows: B }: Cell): Promise<CellResult> {
  const [x, y] = [await open(first), await open(second)]
  if (x.layers !== y.layers || x.kvH !== y.kvH || x.hd !== y.hd) throw new Error('the two shards are of different models')
  const { layers, kvH, hd, maxPositions } = x
  // The past buffer the engine would feed: a block with room for the new column (kv-block.ts).
  const W = blockCapacity(C + 1, maxPositions)
  let seed = 12345
  const next = (): number => { seed = (Math.imul(seed, 1103515245) + 12345) >>> 0; return ((seed >>> 8) / 16777216 - 0.5) * 0.2 }
  const feeds: Record<string, ort.Tensor> = {
    [INPUT_IDS]: new ort.Tensor('int64', BigInt64Array.from({ length: B }, (_, i) => BigInt(5 + i)), [B, 1]),
    [POSITION_IDS]: new ort.Tensor('int64', new BigInt64Array(B).fill(BigInt(C)), [B, 1]),
    [ATTENTION_MASK]: new ort.Tensor('int64', new BigInt64Array(B * (C + 1)).fill(1n), [B, C + 1]),
    [NUM_LOGITS_TO_KEEP]: new ort.Tensor('int64', BigInt64Array.of(1n), []),
  }
  for (let l = 0; l < layers; l++) {
    for (const name of [pastKeyName(l), pastValueName(l)]) {
      const data = Float32Array.from({ length: B * kvH * W * hd }, next)
      for (let r = 0; r < B * kvH; r++) data.fill(0, (r * W + C) * hd, (r + 1) * W * hd)
      feeds[name] = new ort.Tensor('float32', data, [B, kvH, W, hd])
    }
  }
  const fetches = [GREEDY_TOKEN, NEW_KV]
  const [ox, oy] = [await x.session.run(feeds, fetches), await y.session.run(feeds, fetches)]
  const bytes = (t: ort.Tensor): Buffer => Buffer.from((t.data as Float32Array | BigInt64Array).buffer)
  const sameTokens = bytes(ox[GREEDY_TOKEN]!).equals(bytes(oy[GREEDY_TOKEN]!))
  const sameKv = bytes(ox[NEW_KV]!).equals(bytes(oy[NEW_KV]!))
  const ms: [number[], number[]] = [[], []]
  const warm = Math.max(100, RUNS / 4)
  for (let i = 0; i < 2 * (RUNS + warm); i++) {
    const [side, times] = i % 2 === 0 ? [x, ms[0]] : [y, ms[1]]
    const t = performance.now()
    await side.session.run(feeds, fetches)
    if (i >= 2 * warm) times.push(performance.now() - t)
  }
  await x.session.release()
  await y.session.release()
  return { firstMs: median(ms[0]), secondMs: median(ms[1]), ratio: median(ms[1].map((v, i) => v / ms[0][i]!)), sameTokens, sameKv }
}

if (args.cell !== undefined) {
  process.stdout.write(`${JSON.stringify(await timeCell(JSON.parse(args.cell) as Cell))}\n`)
} else {
  if (args.a === undefined || args.b === undefined) throw new Error('--a and --b name the two shard directories')
  const [a, b] = [resolve(args.a), resolve(args.b)]
  const self = fileURLToPath(import.meta.url)
  const loadBefore = loadAverage(2)
  const run = (cell: Cell): CellResult => JSON.parse(execFileSync(process.execPath, [self, '--cell', JSON.stringify(cell), '--runs', String(RUNS)], { encoding: 'utf8' }).trim().split('\n').at(-1)!) as CellResult
  console.log('| context | rows | A ms (mean of its two medians) | B ms | B ÷ A, A run first | B ÷ A, B run first | geometric mean | same greedy tokens / new KV bits |')
  console.log('|---:|---:|---:|---:|---:|---:|---:|---|')
  for (const context of args.contexts.split(',').map(Number)) {
    for (const rows of args.rows.split(',').map(Number)) {
      const ab = run({ first: a, second: b, context, rows })
      const ba = run({ first: b, second: a, context, rows })
      const aFirst = ab.ratio
      const bFirst = 1 / ba.ratio
      console.log(`| ${context} | ${rows} | ${((ab.firstMs + ba.secondMs) / 2).toFixed(3)} | ${((ab.secondMs + ba.firstMs) / 2).toFixed(3)} | ${aFirst.toFixed(3)} | ${bFirst.toFixed(3)} | **${Math.sqrt(aFirst * bFirst).toFixed(3)}** | ${ab.sameTokens ? 'yes' : 'NO'} / ${ab.sameKv ? 'yes' : 'NO'} |`)
    }
  }
  console.log(`\n- command: node reproduction/ab-graph-steps.ts ${process.argv.slice(2).join(' ')}`)
  console.log(`- A: ${a}; B: ${b}`)
  console.log(`- machine: ${lscpuModel()}; Node ${process.version}; onnxruntime-node ${ort.env.versions.common}; malloc: ${mallocSettings()}; git ${gitDescribe(join(self, '..', '..'))}`)
  console.log(`- load average: before ${loadBefore}, after ${loadAverage(2)}`)
}
