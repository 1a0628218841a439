/**
 * What the one-position attention costs by itself (issue 11; docs/engine-notes.md, wave 26): the
 * 8 layers' decode attention of the 60m shape, built from the compiler's own nodes
 * (`decodeAttentionNodes`, either form), each layer's context fed to the next as its q, over
 * past buffers of `context` live columns (16 more of room, masked), B rows. Timed bare with the
 * engine's session settings (graph optimisation 'all', sequential, intra-op threads spinning only
 * within a run), 1 or 2 intra-op threads. Each cell runs in a process of its own, the cells in a
 * different order each round, so no variant times another's caches.
 *
 * What it answers: how much of this attention is fixed cost (a short context) against reading the
 * past (a long one), and what a second intra-op thread does to it (at one row it makes it slower
 * here: each batched MatMul hands its kv heads to the pool however small each product is).
 * `--native` adds the same work as one fused C loop on one thread (reproduction/native/
 * fused-attention.c, built with `cc -O3 -march=native -ffast-math` by lib/native-kernels.ts;
 * cells 'c-loop'): what a custom kernel would be worth bare (wave 33). The form 'native' (in
 * --forms) is such a kernel inside onnxruntime: its cells' processes get
 * daemon/engine/native/ort-kernels.c preloaded (lib/native-kernels.ts, wave 34).
 *
 *   node reproduction/bench-decode-attention.ts [--forms grouped,per-head(,native)] [--contexts 16,192]
 *     [--batches 1,8] [--threads 1,2] [--rounds 3] [--runs 1000] [--native]
 * Run it as the other benchmarks (`chrt -r 10 node …`, nothing else on the machine). Prints each
 * cell's median µs a run (each round's median of --runs runs, after --runs / 2 untimed ones), as
 * the range over the rounds.
 */
import { execFileSync } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { performance } from 'node:perf_hooks'
import { fileURLToPath } from 'node:url'
import { parseArgs } from 'node:util'
import ort from 'onnxruntime-node'
import { sessionOptions } from '../daemon/engine/backend/onnxruntime.ts'
import { DECODE_ATTENTION_FORMS, type DecodeAttentionForm } from '../shards/contract.ts'
import { buildFusedLoop, buildNativeKernels, nativeKernelsEnv } from './lib/native-kernels.ts'
import { decodeAttentionNodes } from '../shards/graph/attention.ts'
import { DT, GraphBuilder } from '../shards/graph/builder.ts'
import { gitDescribe, loadAverage, lscpuModel, median } from './lib/index.ts'
import { H, HD, KVH, LAYERS } from './lib/attention-shape.ts'
import { execWithServeMalloc, mallocSettings } from './lib/malloc.ts'

// The engine runs in this process, and in any child that inherits its environment: with `shoal
// serve`'s malloc settings, as served (reproduction/lib/malloc.ts).
execWithServeMalloc()

/** 'c-loop': reproduction/native/fused-attention.c on one thread, beside onnxruntime's forms. */
interface Cell { form: DecodeAttentionForm | 'c-loop', context: number, batch: number, threads: number }

const { values: args } = parseArgs({
  options: {
    forms: { type: 'string', default: 'grouped,per-head' },
    contexts: { type: 'string', default: '16,192' },
    batches: { type: 'string', default: '1,8' },
    threads: { type: 'string', default: '1,2' },
    rounds: { type: 'string', default: '3' },
    runs: { type: 'string', default: '1000' },
    cell: { type: 'string' },
    native: { type: 'boolean', default: false },
  },
})
const RUNS = Number(args.runs)
const numbers = (s: string): number[] => s.split(',').map(Number)

/** Room past the live columns, as the engine's blocks keep (kv-block.ts): masked, never read as live. */
const ROOM = 16

/** One cell, timed in this process: the median µs of a run. */
async function timeCell ({ form, context, batch: B, threads }: Cell & { form: DecodeAttentionForm }): Promise<number> {
  const W = context + ROOM
  const g = new GraphBuilder('a.onnx.data')
  let q = g.input('q', DT.FLOAT, ['b', 1, H * HD])
  const k = g.input('k', DT.FLOAT, ['b', 1, KVH * HD])
  const v = g.input('v', DT.FLOAT, ['b', 1, KVH * HD])
  const bias = g.input('bias', DT.FLOAT, ['b', 1, 1, 'w'])
  const ones = g.input('ones', DT.FLOAT, ['w', 1])
  const seqlensK = g.input('seqlens_k', DT.INT32, ['b'])
  for (let l = 0; l < LAYERS; l++) {
    const pastK = g.input(`past_k${l}`, DT.FLOAT, ['b', KVH, 'w', HD])
    const pastV = g.input(`past_v${l}`, DT.FLOAT, ['b', KVH, 'w', HD])
    q = decodeAttentionNodes(g, { numHeads: H, numKvHeads: KVH, headDim: HD }, form, `/l${l}`, { q, k, v }, pastK, pastV, { bias, ones, seqlensK })[0]!
  }
  g.output('out', q, DT.FLOAT, ['b', 1, H * HD])
  const dir = mkdtempSync(join(tmpdir(), 'shoal-decode-attention-'))
  try {
    writeFileSync(join(dir, 'a.onnx'), g.encode('decode-attention', 'the 8 layers\' one-position attention alone'))
    writeFileSync(join(dir, 'a.onnx.data'), Buffer.concat(g.data()))
    const session = await ort.InferenceSession.create(join(dir, 'a.onnx'), sessionOptions({ threads }))
    const filled = (n: number, phase: number): Float32Array => Float32Array.from({ length: n }, (_, i) => Math.sin(i * 0.37 + phase) * 0.1)
    const biasData = new Float32Array(B * W)
    for (let b = 0; b < B; b++) biasData.fill(-Infinity, b * W + context, (b + 1) * W)
    const feeds: Record<string, ort.Tensor> = {
      q: new ort.Tensor('float32', filled(B * H * HD, 1), [B, 1, H * HD]),
      k: new ort.Tensor('float32', filled(B * KVH * HD, 2), [B, 1, KVH * HD]),
      v: new ort.Tensor('float32', filled(B * KVH * HD, 3), [B, 1, KVH * HD]),
      bias: new ort.Tensor('float32', biasData, [B, 1, 1, W]),
      ones: new ort.Tensor('float32', new Float32Array(W).fill(1), [W, 1]),
      seqlens_k: new ort.Tensor('int32', new Int32Array(B).fill(context), [B]),
    }
    for (let l = 0; l < LAYERS; l++) {
      feeds[`past_k${l}`] = new ort.Tensor('float32', filled(B * KVH * W * HD, 4 + l), [B, KVH, W, HD])
      feeds[`past_v${l}`] = new ort.Tensor('float32', filled(B * KVH * W * HD, 20 + l), [B, KVH, W, HD])
    }
    for (let i = 0; i < RUNS / 2; i++) await session.run(feeds)
    const ms: number[] = []
    for (let i = 0; i < RUNS; i++) {
      const t = performance.now()
      await session.run(feeds)
      ms.push(performance.now() - t)
    }
    await session.release()
    return median(ms) * 1000
  } finally {
    rmSync(dir, { recursive: true, force: true })
  }
}

if (args.cell !== undefined) {
  process.stdout.write(`${JSON.stringify({ us: await timeCell(JSON.parse(args.cell) as Cell & { form: DecodeAttentionForm }) })}\n`)
} else {
  const forms = args.forms.split(',') as DecodeAttentionForm[]
  for (const f of forms) if (!DECODE_ATTENTION_FORMS.includes(f)) throw new Error(`--forms: ${f} is not one of ${DECODE_ATTENTION_FORMS.join(', ')}`)
  const cells: Cell[] = []
  for (const form of forms) for (const context of numbers(args.contexts)) for (const batch of numbers(args.batches)) for (const threads of numbers(args.threads)) cells.push({ form, context, batch, threads })
  if (args.native) for (const context of numbers(args.contexts)) for (const batch of numbers(args.batches)) cells.push({ form: 'c-loop', context, batch, threads: 1 })
  // The 'native' form's cells run with the fused kernel preloaded; the others as shipped.
  const kernelEnv = forms.includes('native') ? { ...process.env, ...nativeKernelsEnv(await buildNativeKernels()) } : process.env
  const loop = args.native ? await buildFusedLoop() : undefined
  const loadBefore = loadAverage(2)
  const results = new Map<Cell, number[]>(cells.map(c => [c, []]))
  const self = fileURLToPath(import.meta.url)
  for (let round = 0; round < Number(args.rounds); round++) {
    // A different order each round: a cell's neighbours in time change.
    const order = round % 2 === 0 ? cells : [...cells].reverse()
    for (const cell of order) {
      const out = cell.form === 'c-loop'
        ? execFileSync(loop!, [String(cell.batch), String(cell.context), String(RUNS)], { encoding: 'utf8' })
        : execFileSync(process.execPath, [self, '--cell', JSON.stringify(cell), '--runs', String(RUNS)], { encoding: 'utf8', env: cell.form === 'native' ? kernelEnv : process.env })
      results.get(cell)!.push((JSON.parse(out.trim().split('\n').at(-1)!) as { us: number }).us)
    }
  }
  console.log('| form | context | rows | intra-op threads | µs a run (median of each round: min–max) |')
  console.log('|---|---:|---:|---:|---:|')
  for (const c of cells) {
    const us = results.get(c)!
    console.log(`| ${c.form} | ${c.context} | ${c.batch} | ${c.threads} | ${Math.min(...us).toFixed(0)}–${Math.max(...us).toFixed(0)} |`)
  }
  console.log(`\n- command: node reproduction/bench-decode-attention.ts ${process.argv.slice(2).join(' ')}`)
  console.log(`- machine: ${lscpuModel()}; Node ${process.version}; onnxruntime-node ${ort.env.versions.common}; malloc: ${mallocSettings()}; git ${gitDescribe(join(self, '..', '..'))}`)
  console.log(`- load average: before ${loadBefore}, after ${loadAverage(2)}`)
}
