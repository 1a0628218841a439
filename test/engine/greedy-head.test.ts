/**
 * An f32 head's greedy token on shoal's kernel (daemon/engine/native greedy-head.h, GreedyHead;
 * swap.ts swapHead; head-check.ts): the token onnxruntime's Gemm and TopK give, bit for bit, from
 * an int8 screen and the exact sums of the rows it cannot rule out. Op against op on heads made to
 * be hard (exact ties, rows one ulp apart, outliers in a row or in x, zero and constant rows, rows
 * that are not finite or whose sums overflow, x that is not finite, all-equal logits) and on random ones; the swap, pure;
 * the self-check; and through the engine's backend, a greedy run skipping the head's product while
 * its tokens stay the logits' argmax, alone and batched; and a daemon saying so on its 'model
 * loaded' line, its greedy completions the tokens its logits give.
 */
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { dirname, join } from 'node:path'
import * as ort from 'onnxruntime-node'
import onnxProto from 'onnx-proto'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { argmax, createOnnxruntimeBackend, createStageRunner, GREEDY_PICK as GREEDY, prepareNativeKernels, stageInfoOf, swapKernels } from '../../daemon/engine/index.ts'
import type { BackendSession, PrefixKeepingRunner, TensorMap } from '../../daemon/engine/index.ts'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { greedyHeadExact } from '../../daemon/engine/native/head-check.ts'
import { LOGITS_WANTED } from '../../daemon/engine/native/swap.ts'
import { GREEDY_TOKEN, LOGITS, NATIVE_KERNEL_DOMAIN, NEW_KV } from '../../shards/contract.ts'
import { DT, GraphBuilder } from '../../shards/graph/builder.ts'
import pino from 'pino'
import { startDaemon } from '../e2e/daemon.ts'
import { greedyByLogits, positions, tokenOf } from './greedy-batches.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const { onnx } = onnxProto
const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()

/** A seeded generator (Math.imul: a double product would lose the low bits), uniform in [−0.5, 0.5). */
function generator (seed: number): () => number {
  let s = seed
  return () => { s = (Math.imul(s, 1103515245) + 12345) >>> 0; return (s >>> 8) / 16777216 - 0.5 }
}

/** Roughly normal, as trained weights and normed states are. */
const normal = (rand: () => number): number => (rand() + rand() + rand() + rand()) * 1.7

/** The next float above x. */
function nextUp (x: number): number {
  const f = new Float32Array([x])
  const u = new Uint32Array(f.buffer)
  if (x === 0) u[0] = 1
  else if (x > 0) u[0]!++
  else u[0]!--
  return f[0]!
}

/** Heads made to be hard for a screen, and one that is not. */
function heads (V: number, K: number): Array<{ name: string, w: Float32Array }> {
  const rand = generator(V * 7 + K)
  const random = Float32Array.from({ length: V * K }, () => normal(rand) * 0.02)
  const out = [{ name: 'random', w: random }]
  // Every row one of 7: exact ties everywhere; TopK takes the lowest index of the best.
  const tied = new Float32Array(V * K)
  for (let j = 0; j < V; j++) tied.set(random.subarray((j % 7) * K, (j % 7 + 1) * K), j * K)
  out.push({ name: 'tied rows', w: tied })
  // Pairs of rows one ulp apart in one column: within any screen's error.
  const ulps = Float32Array.from(random)
  for (let j = 1; j < V; j += 2) {
    ulps.set(ulps.subarray((j - 1) * K, j * K), j * K)
    ulps[j * K + (j % K)] = nextUp(ulps[j * K + (j % K)]!)
  }
  out.push({ name: 'rows one ulp apart', w: ulps })
  // A row with one huge element (its 7-bit scale coarse), zero rows, constant rows.
  const odd = Float32Array.from(random)
  for (let j = 0; j < V; j += 5) odd[j * K + (j % K)] = 40
  for (let j = 2; j < V; j += 11) odd.fill(0, j * K, (j + 1) * K)
  for (let j = 3; j < V; j += 13) odd.fill(0.01, j * K, (j + 1) * K)
  out.push({ name: 'outliers, zero and constant rows', w: odd })
  // A row that is not finite: the kernel sums every row exactly, as the Gemm does.
  const inf = Float32Array.from(random)
  inf[9 * K + 1] = Number.POSITIVE_INFINITY
  inf[20 * K + 2] = Number.NaN
  out.push({ name: 'rows with ∞ and NaN', w: inf })
  // Row 0's logit NaN: TopK's scan starts there and never leaves it (a later NaN never takes over).
  const nan0 = Float32Array.from(random)
  nan0[3] = Number.NaN
  out.push({ name: 'row 0 NaN (∞ path)', w: nan0 })
  // Rows near the float range: some of their f32 sums overflow to ±∞, as the Gemm's do.
  const huge = Float32Array.from(random)
  for (let j = 0; j < V; j += 9) for (let k = 0; k < K; k++) huge[j * K + k]! *= 5e37
  out.push({ name: 'rows whose sums overflow (∞)', w: huge })
  return out
}

/** Rows of x made to be hard, and random ones. */
function states (K: number, rows: number, seed: number): Float32Array {
  const rand = generator(seed)
  const x = Float32Array.from({ length: rows * K }, () => normal(rand))
  x[0] = 300 // row 0: one outlier (its 7-bit scale coarse)
  x.fill(0, K, 2 * K) // row 1: all zeros (every logit 0: TopK's index 0)
  if (rows > 3) x[3 * K + 5] = Number.NaN // row 3: not finite
  if (rows > 4) x[4 * K + 7] = Number.NEGATIVE_INFINITY
  return x
}

describe.skipIf(!kernelHere)('GreedyHead against onnxruntime\'s Gemm and TopK', () => {
  let dir: string
  let lib: string
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'shoal-greedy-head-'))
    const kernels = await prepareNativeKernels(join(dir, 'kernels'))
    if (!('lib' in kernels)) throw new Error(`the kernels did not build here: ${kernels.off}`)
    lib = kernels.lib
  }, 120_000)
  afterAll(async () => { if (dir !== undefined) await rm(dir, { recursive: true, force: true }) })

  /** One graph: the Gemm's logits and TopK's token, and GreedyHead's token and exact sums, for `w` [V, K]. */
  async function compare (w: Float32Array, V: number, K: number, x: Float32Array, rows: number): Promise<{ tokens: bigint[], greedy: bigint[], logits: Float32Array, exact: Float32Array }> {
    const g = new GraphBuilder('h.onnx.data')
    const xs = g.input('x', DT.FLOAT, ['b', 1, K])
    const wt = g.f32Weight('w', [V, K], w)
    const logits = g.op('Gemm', '/gemm', [g.op('Reshape', '/flat', [xs, g.i64([-1, K])]), wt], { transB: 1 })
    const top = g.node('TopK', '/topk', [logits, g.i64([1])], { axis: -1, largest: 1, sorted: 1 }, 2)[1]!
    const [exact, token] = g.node('GreedyHead', '/head', [xs, wt], { exact_logits: 1 }, 2, NATIVE_KERNEL_DOMAIN)
    g.output('logits', logits, DT.FLOAT, ['m', V])
    g.output('token', top, DT.INT64, ['m', 1])
    g.output('exact', exact!, DT.FLOAT, ['b', 1, V])
    g.output('greedy', token!, DT.INT64, ['b', 1, 1])
    const sub = await mkdtemp(join(dir, 'g-'))
    await writeFile(join(sub, 'h.onnx'), g.encode('h', 'greedy head'))
    await writeFile(join(sub, 'h.onnx.data'), Buffer.concat(g.data()))
    const session = await ort.InferenceSession.create(join(sub, 'h.onnx'), { executionProviders: ['cpu'], graphOptimizationLevel: 'all', intraOpNumThreads: 2, logSeverityLevel: 3 })
    try {
      const out = await session.run({ x: new ort.Tensor('float32', x, [rows, 1, K]) })
      return { tokens: [...out.token!.data as BigInt64Array], greedy: [...out.greedy!.data as BigInt64Array], logits: out.logits!.data as Float32Array, exact: out.exact!.data as Float32Array }
    } finally {
      await session.release()
    }
  }

  // K 300: a whole block of 256 and a partial one; K 64 and 1,000 as the small and 250m-like heads.
  for (const [V, K] of [[517, 300], [1000, 64], [300, 1000]] as const) {
    it(`gives TopK's token for every row, and the Gemm's logits bit for bit, on hard heads (V ${V}, K ${K})`, async () => {
      for (const { name, w } of heads(V, K)) {
        const rows = 9
        const x = states(K, rows, V + K)
        const r = await compare(w, V, K, x, rows)
        expect(r.greedy, name).toEqual(r.tokens)
        // The JS argmax a step that fetches the logits takes: TopK's token too, NaN rows included.
        expect(Array.from({ length: rows }, (_, b) => BigInt(argmax(r.logits, b * V, V))), name).toEqual(r.tokens)
        const finite = !name.includes('∞')
        if (finite) expect(new Uint32Array(r.exact.buffer)).toEqual(new Uint32Array(r.logits.buffer))
        // The tied head has a tie in every row: the lowest index of the best of its 7 rows.
        if (name === 'tied rows') for (const t of r.greedy) expect(Number(t)).toBeLessThan(7)
      }
    }, 60_000)
  }

  it('keeps a row whose f32 sum overflows on the way (∞ though its real sum is 0) among the candidates, as TopK picks it', async () => {
    const [V, K] = [4, 8]
    const w = new Float32Array(V * K)
    w.set([2e38, 2e38, -2e38, -2e38], 0) // row 0: the Gemm's chain reaches ∞ at its second column and stays there
    w[K] = 1e35 // row 1: a finite logit far above any bound the screen puts on row 0
    w.fill(1, 3 * K, 4 * K)
    const x = Float32Array.from([1, 1, 1, 1, 0, 0, 0, 0])
    const r = await compare(w, V, K, x, 1)
    expect(r.logits[0]).toBe(Number.POSITIVE_INFINITY)
    expect(r.tokens).toEqual([0n])
    expect(r.greedy).toEqual(r.tokens)
  })

  it('scans as TopK does when a sum is NaN (∞ − ∞ across blocks): row 0 first, a later NaN never taken', async () => {
    const [V, K] = [3, 512]
    const w = new Float32Array(V * K)
    w[0] = 0.5 // row 0: a small finite logit, which the screen alone would rule out
    w.set([2e38, 2e38], K) // row 1: +∞ over the first 256 columns …
    w.set([-2e38, -2e38], K + 256) // … −∞ over the next: NaN
    w[2 * K + 300] = 1e35 // row 2: the largest
    const x = new Float32Array(K)
    x.fill(1, 0, 2)
    x.fill(1, 256, 258)
    x[300] = 1
    const r = await compare(w, V, K, x, 1)
    expect(Number.isNaN(r.logits[1])).toBe(true)
    expect(r.tokens).toEqual([2n])
    expect(r.greedy).toEqual(r.tokens)
  })

  it('gives TopK\'s token on 2,000 random rows, where the screen rules out all but a few', async () => {
    const [V, K] = [4000, 512]
    const rand = generator(99)
    const w = Float32Array.from({ length: V * K }, () => normal(rand) * 0.02)
    for (let batch = 0; batch < 5; batch++) {
      const rows = 400
      const x = Float32Array.from({ length: rows * K }, () => normal(rand) * (1 + batch))
      const r = await compare(w, V, K, x, rows)
      expect(r.greedy).toEqual(r.tokens)
    }
  }, 60_000)

  it('passes its self-check here', async () => {
    expect(await greedyHeadExact(lib)).toBe(true)
  })
})

describe('the head swap (swap.ts swapHead)', () => {
  let model: TinyModel
  beforeAll(async () => { model = await buildTinyModel('llama') }, 60_000)
  afterAll(async () => { await model?.cleanup() })

  it('makes the head\'s Gemm and TopK an If on LOGITS_WANTED whose other branch is one GreedyHead, only when asked', async () => {
    const bytes = await readFile(model.graphPath)
    expect(swapKernels(bytes).head).toBe(0)
    const swapped = swapKernels(bytes, { head: true })
    expect(swapped.head).toBe(1)
    const g = onnx.ModelProto.decode(swapped.bytes).graph!
    expect(g.input!.map(i => i.name)).toContain(LOGITS_WANTED)
    const branch = g.node!.find(n => n.name === '/lm_head/If')!
    expect(branch.input).toEqual([LOGITS_WANTED])
    expect(branch.output).toEqual([LOGITS, GREEDY_TOKEN])
    const [then, otherwise] = ['then_branch', 'else_branch'].map(a => branch.attribute!.find(x => x.name === a)!.g!)
    expect(then!.node!.map(n => n.opType)).toEqual(['Gemm', 'Reshape', 'TopK'])
    expect(otherwise!.node!.map(n => [n.opType, n.domain])).toEqual([['GreedyHead', NATIVE_KERNEL_DOMAIN]])
    expect(g.node!.some(n => n.opType === 'Gemm' || n.opType === 'TopK')).toBe(false)
  })

  it('leaves the head where something else reads the TopK\'s values (the branch would hide them)', async () => {
    const m = onnx.ModelProto.decode(await readFile(model.graphPath))
    const topk = m.graph!.node!.find(n => n.name === '/model/greedy/TopK')!
    m.graph!.output!.push(onnx.ValueInfoProto.create({ name: topk.output![0]!, type: onnx.TypeProto.create({ tensorType: onnx.TypeProto.Tensor.create({ elemType: onnx.TensorProto.DataType.FLOAT }) }) }))
    expect(swapKernels(onnx.ModelProto.encode(m).finish(), { head: true }).head).toBe(0)
  })

  it('leaves a graph without a greedy f32 head as it is (a standard-ops shard: its logits only)', async () => {
    const standard = await buildTinyModel('llama', 'standard')
    try {
      expect(swapKernels(await readFile(standard.graphPath), { head: true }).head).toBe(0)
    } finally {
      await standard.cleanup()
    }
  }, 60_000)
})

describe.skipIf(!kernelHere)('a greedy run on the swapped head', () => {
  let model: TinyModel
  let root: string
  let lib: string
  let runner: PrefixKeepingRunner
  const fetched: Array<readonly string[] | undefined> = []

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-greedy-head-run-'))
    const kernels = await prepareNativeKernels(join(root, 'kernels'))
    if (!('lib' in kernels)) throw new Error(`the kernels did not build here: ${kernels.off}`)
    lib = kernels.lib
    model = await buildTinyModel('llama')
    const real = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1, kernels: lib })
    const session: BackendSession = { ...real, async run (feeds, fetches): Promise<TensorMap> { fetched.push(fetches); return await real.run(feeds, fetches) } }
    runner = createStageRunner({ session, stage: stageInfoOf(model.manifest), chunkSize: 8 })
    // The flag is the backend's to feed: runners never see it.
    expect(real.inputNames).not.toContain(LOGITS_WANTED)
  }, 120_000)
  afterAll(async () => {
    await model?.cleanup()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('skips the head\'s product: fed false, the graph gives the token and empty logits', async () => {
    const swapped = swapKernels(await readFile(model.graphPath), { head: true })
    const session = await ort.InferenceSession.create(swapped.bytes, { executionProviders: ['cpu'], logSeverityLevel: 3, extra: { session: { model_external_initializers_file_folder_path: dirname(model.graphPath) } } })
    try {
      const { numLayers, numKvHeads: kvH, headDim: hd } = model.manifest.shape
      const feeds: Record<string, ort.Tensor> = {
        input_ids: new ort.Tensor('int64', BigInt64Array.of(5n, 6n, 7n), [1, 3]),
        position_ids: new ort.Tensor('int64', BigInt64Array.of(0n, 1n, 2n), [1, 3]),
        attention_mask: new ort.Tensor('int64', BigInt64Array.of(1n, 1n, 1n), [1, 3]),
        num_logits_to_keep: new ort.Tensor('int64', BigInt64Array.of(1n), []),
      }
      for (let l = 0; l < numLayers; l++) for (const kind of ['key', 'value']) feeds[`past_key_values.${l}.${kind}`] = new ort.Tensor('float32', new Float32Array(0), [1, kvH, 0, hd])
      const full = await session.run({ ...feeds, [LOGITS_WANTED]: new ort.Tensor('bool', [true], []) }, [LOGITS, GREEDY_TOKEN])
      const greedy = await session.run({ ...feeds, [LOGITS_WANTED]: new ort.Tensor('bool', [false], []) }, [LOGITS, GREEDY_TOKEN])
      expect(full[LOGITS]!.dims).toEqual([1, 1, model.manifest.shape.vocabSize])
      expect(greedy[LOGITS]!.dims).toEqual([1, 1, 0])
      expect(greedy[GREEDY_TOKEN]!.data).toEqual(full[GREEDY_TOKEN]!.data)
      expect(Number((full[GREEDY_TOKEN]!.data as BigInt64Array)[0])).toBe(argmax(full[LOGITS]!.data as Float32Array))
    } finally {
      await session.release()
    }
  })

  const ids = (n: number, salt: number): bigint[] => Array.from({ length: n }, (_, i) => BigInt((i * 37 + salt * 101 + 5) % 500))
      
  const byLogits = async (seqId: string, prompt: bigint[], steps: number): Promise<number[]> => await greedyByLogits(runner, seqId, prompt, steps)

  it('alone and batched, greedy steps on GreedyHead give the logits\' argmax for every token', async () => {
    const prompts = [ids(30, 1), ids(3, 2), ids(17, 4), ids(5, 5)]
    const want: number[][] = []
    for (const [i, p] of prompts.entries()) want.push(await byLogits(`ref${i}`, p, 32))
    const got: number[][] = prompts.map(() => [])
    const from = fetched.length
    for (const [i, p] of prompts.entries()) {
      runner.open(`b${i}`)
      got[i]!.push(tokenOf(await runner.step(`b${i}`, { kind: 'tokens', ids: BigInt64Array.from(p) }, positions(0, p.length), 1, GREEDY)))
    }
    for (let k = 1; k < 32; k++) {
      const res = await runner.stepBatch(prompts.map((p, i) => ({
        seqId: `b${i}`,
        input: { kind: 'tokens' as const, ids: BigInt64Array.of(BigInt(got[i]!.at(-1)!)) },
        positions: positions(p.length + k - 1, 1),
        logitsToKeep: 1,
        pick: GREEDY,
      })))
      for (const [i, r] of res.entries()) {
        if (!('output' in r)) throw r.error
        got[i]!.push(tokenOf(r.output))
      }
    }
    for (const i of prompts.keys()) await runner.drop(`b${i}`, 'free')
    expect(got).toEqual(want)
    expect(fetched.slice(from).every(f => f?.[0] === GREEDY_TOKEN && !f.includes(LOGITS))).toBe(true)
    expect(fetched.slice(from).some(f => f?.includes(NEW_KV))).toBe(true)
  }, 60_000)
})

describe.skipIf(!kernelHere)('a daemon serving an f32 model', () => {
  let model: TinyModel
  let root: string
  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-greedy-head-daemon-'))
    model = await buildTinyModel('llama')
  }, 60_000)
  afterAll(async () => {
    await model?.cleanup()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('says its greedy tokens run on GreedyHead, and they are the tokens its logits give (a nucleus of the top token alone)', async () => {
    const lines: Array<Record<string, unknown>> = []
    const logger = pino({ level: 'info' }, { write: (s: string) => { lines.push(JSON.parse(s) as Record<string, unknown>) } })
    const daemon = await startDaemon(model.shardDir, root, { draft: 'none' }, logger)
    try {
      expect(lines.find(l => l.msg === 'model loaded')?.greedyHead).toBe('shoal')
      const ask = async (prompt: number[], sampled: boolean): Promise<number[]> => {
        const r = await daemon.client.completions.create({
          model: model.manifest.modelId, prompt, max_tokens: 24, ...sampled ? { temperature: 1, top_p: 1e-9, seed: 7 } : { temperature: 0 },
          // @ts-expect-error vLLM-style extension
          return_token_ids: true, ignore_eos: true,
        })
        return (r.choices[0] as unknown as { token_ids: number[] }).token_ids
      }
      for (const prompt of [[5, 6, 7], [11, 300, 42, 9, 17, 250, 3]]) {
        const greedy = await ask(prompt, false)
        expect(greedy).toHaveLength(24)
        expect(greedy).toEqual(await ask(prompt, true))
      }
    } finally {
      await daemon.stop()
    }
  }, 120_000)
})
