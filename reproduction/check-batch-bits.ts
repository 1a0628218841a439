/**
 * Batched decode against each row alone, bit for bit, on a compiled one-stage shard through the
 * engine's own runner (its KV blocks, its widths): eight prompts of 3–301 tokens, each decoded
 * greedily alone, then all eight prefilled and decoded together; prints how many (row, step)
 * logits differ in any bit. The test suite proves the same on tiny models
 * (test/shards/contrib.test.ts, test/engine/batched-step.test.ts); this runs it at the sizes and
 * widths the benchmarks use — after an onnxruntime upgrade, or a change to the one-position
 * attention or the blocks' widths (docs/engine-notes.md, wave 12: one query head a product over
 * blocks not a multiple of 16 wide differed in 131 of 472).
 *
 *   node reproduction/check-batch-bits.ts SHARD_DIR [steps, default 60]
 */
import { join } from 'node:path'
import { argmax, createOnnxruntimeBackend, createStageRunner, stageInfoOf } from '../daemon/engine/index.ts'
import type { StepOutput } from '../daemon/engine/index.ts'
import { loadManifest } from '../shards/index.ts'
const dir = process.argv[2]!
const STEPS = Number(process.argv[3] ?? 60)
const m = await loadManifest(dir)
const stage = m.stages[0]!
const session = await createOnnxruntimeBackend().load(join(dir, ...stage.graph.split('/')), { device: 'CPU', threads: 2 })
const runner = createStageRunner({ session, stage: stageInfoOf(m), chunkSize: 512 })
const lens = [3, 17, 40, 61, 100, 130, 255, 301]
const prompt = (n: number, salt: number): bigint[] => Array.from({ length: n }, (_, i) => BigInt((i * 37 + salt * 101 + 5) % m.shape.vocabSize))
const last = (o: StepOutput): Float32Array => {
  if (o.kind !== 'logits') throw new Error('expected logits')
  return o.data.subarray(o.data.length - o.vocab)
}
// Alone.
const alone: Float32Array[][] = []
for (const [s, n] of lens.entries()) {
  const id = `a${s}`
  runner.open(id)
  let o = await runner.step(id, { kind: 'tokens', ids: BigInt64Array.from(prompt(n, s)) }, BigInt64Array.from({ length: n }, (_, i) => BigInt(i)), 1)
  const rows: Float32Array[] = []
  for (let k = 0; k < STEPS; k++) {
    rows.push(last(o).slice())
    const t = argmax(last(o))
    o = await runner.step(id, { kind: 'tokens', ids: BigInt64Array.of(BigInt(t)) }, BigInt64Array.of(BigInt(n + k)), 1)
  }
  alone.push(rows)
  await runner.drop(id, 'free')
}
// Together: prefill each, then decode all in one batch each step.
const toks: number[] = []
for (const [s, n] of lens.entries()) {
  const id = `b${s}`
  runner.open(id)
  const o = await runner.step(id, { kind: 'tokens', ids: BigInt64Array.from(prompt(n, s)) }, BigInt64Array.from({ length: n }, (_, i) => BigInt(i)), 1)
  toks.push(argmax(last(o)))
}
const same = (a: Float32Array, b: Float32Array): boolean =>
  Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(Buffer.from(b.buffer, b.byteOffset, b.byteLength))
let diff = 0
let firstDiff = ''
for (let k = 1; k < STEPS; k++) {
  const res = await runner.stepBatch(lens.map((n, s) => ({ seqId: `b${s}`, input: { kind: 'tokens' as const, ids: BigInt64Array.of(BigInt(toks[s]!)) }, positions: BigInt64Array.of(BigInt(n + k - 1)), logitsToKeep: 1 })))
  res.forEach((r, s) => {
    if ('error' in r) throw r.error
    const l = last(r.output)
    if (!same(l, alone[s]![k]!)) {
      diff++
      if (firstDiff === '') firstDiff = `row ${s} (len ${lens[s]}) step ${k}`
    }
    toks[s] = argmax(l)
  })
}
console.log(`${m.modelId}: ${lens.length} rows × ${STEPS - 1} batched steps; rows differing from alone: ${diff}${firstDiff === '' ? '' : `, first ${firstDiff}`}`)
await session.close()
