/**
 * Batched steps on a generated tiny model (fp32; the standard op table, ragged past lengths
 * left-padded, and the default ort-contrib one, right-padded): stepBatch — several sequences in
 * one run — gives the same greedy tokens as stepping each
 * sequence alone, over whole 64-token sequences; the max logit difference is printed. Also:
 * members joining and leaving between steps, an abort inside a batch, per-item errors, the
 * one-at-a-time fallback for graphs without left padding, and KV accounting.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { argmax, createOnnxruntimeBackend, createRng, createStageRunner, nextPick, sampleToken } from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, SamplerParams, StageBatchItem, StageInfo, StepOutput } from '../../daemon/engine/index.ts'
import { parseToWorker } from '../../daemon/engine/protocol.ts'
import { buildTinyModel, startTinyEngine } from './tiny-model.ts'
import type { TinyEngine, TinyModel } from './tiny-model.ts'

const range = (n: number, from = 0): number[] => Array.from({ length: n }, (_, i) => from + i)
const promptOf = (n: number, salt: number): number[] => range(n).map(i => (i * 37 + salt * 101 + 5) % 500)
const PROMPTS = [promptOf(3, 1), promptOf(9, 2), promptOf(9, 3), promptOf(17, 4), promptOf(30, 5)]
const TOKENS = 64

const logitsOf = (out: StepOutput): Float32Array => {
  if (out.kind !== 'logits') throw new Error('expected logits')
  return out.data.subarray((out.count - 1) * out.vocab)
}
function maxDiff (a: Float32Array, b: Float32Array): number {
  let m = 0
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!))
  return m
}

/** Greedy tokens of one sequence stepped alone (batch of one), with each step's last logits. */
async function alone (engine: BatchingStageEngine, prompt: number[]): Promise<{ tokens: number[], logits: Float32Array[] }> {
  const seq = await engine.open()
  const tokens: number[] = []
  const logits: Float32Array[] = []
  let out = await engine.step(seq, { tokenIds: prompt }, range(prompt.length))
  for (;;) {
    const l = logitsOf(out)
    logits.push(l.slice())
    tokens.push(argmax(l))
    if (tokens.length === TOKENS) break
    out = await engine.step(seq, { tokenIds: [tokens.at(-1)!] }, [prompt.length + tokens.length - 1])
  }
  await engine.free(seq)
  return { tokens, logits }
}

describe.each([['standard', 'left'], ['ort-contrib', 'right']] as const)('stepBatch on a tiny generated model, %s ops', (opSet, padding) => {
  let tiny: TinyEngine | undefined
  let model: TinyModel
  let stage: StageInfo
  let engine: BatchingStageEngine
  const want: Array<{ tokens: number[], logits: Float32Array[] }> = []

  beforeAll(async () => {
    tiny = await startTinyEngine({ threads: 1, maxSequences: 8, chunkSize: 16 }, await buildTinyModel('llama', opSet))
    ;({ model, stage, engine } = tiny)
    expect(stage.batchPadding).toBe(padding)
    for (const p of PROMPTS) want.push(await alone(engine, p))
  })
  afterAll(async () => {
    await tiny?.stop()
  })

  it('the step-batch message is checked like a step', () => {
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [] })).toMatch(/non-empty/)
    expect(parseToWorker({ type: 'step-batch', id: 1, items: [{ seqId: 's', input: { kind: 'tokens', ids: [1] }, positions: new BigInt64Array(1), logitsToKeep: 1 }] })).toMatch(/items\[0\].*input/)
  })

  it('a pick is checked: numbers, temperature ≥ 0, topP in (0, 1], u in [0, 1)', () => {
    const step = (pick: unknown): unknown => ({ type: 'step', id: 1, seqId: 's', input: { kind: 'tokens', ids: new BigInt64Array(1) }, positions: new BigInt64Array(1), logitsToKeep: 1, pick })
    for (const bad of [null, {}, { temperature: 0, topP: 1 }, { temperature: -1, topP: 1, u: 0 }, { temperature: 1, topP: 0, u: 0 }, { temperature: 1, topP: 1, u: 1 }, { temperature: Number.NaN, topP: 1, u: 0 }]) {
      expect(parseToWorker(step(bad))).toMatch(/pick/)
    }
    expect(parseToWorker(step({ temperature: 0.7, topP: 0.9, u: 0.5 }))).toMatchObject({ type: 'step' })
  })

  it('tokens picked in the worker equal sampling the returned logits here, greedy and seeded, over 64 tokens', async () => {
    // Five ragged prompts (the 30-token one prefills in chunks, alone; the others share runs).
    for (const params of [{ temperature: 0, topP: 1 }, { temperature: 0.9, topP: 0.95 }] satisfies SamplerParams[]) {
      const run = async (inWorker: boolean): Promise<number[][]> => {
        const seqs = await Promise.all(PROMPTS.map(async (_, i) => await engine.open(`pick-${String(inWorker)}-${i}`)))
        const rngs = PROMPTS.map((_, i) => createRng(1000 + i))
        const tokens: number[][] = PROMPTS.map(() => [])
        let items: StageBatchItem[] = PROMPTS.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: p }, positions: range(p.length) }))
        for (let step = 0; step < TOKENS; step++) {
          if (inWorker) items = items.map((item, i) => ({ ...item, pick: nextPick(params, rngs[i]!) }))
          const results = await engine.stepBatch(items)
          results.forEach((r, i) => {
            if (!('output' in r)) throw r.error
            const out = r.output
            if (inWorker) {
              if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
              tokens[i]!.push(out.id)
            } else {
              tokens[i]!.push(sampleToken(logitsOf(out), params, rngs[i]!))
            }
          })
          items = seqs.map((seqId, i) => ({ seqId, input: { tokenIds: [tokens[i]!.at(-1)!] }, positions: [PROMPTS[i]!.length + step] }))
        }
        for (const s of seqs) await engine.free(s)
        return tokens
      }
      const here = await run(false)
      const there = await run(true)
      expect(there).toEqual(here)
      if (params.temperature === 0) expect(there).toEqual(want.map(w => w.tokens))
      else expect(there).not.toEqual(want.map(w => w.tokens)) // really sampled
    }
  })

  it('five ragged sequences decoded together give the tokens of each alone, over 64 tokens', async () => {
    const seqs = await Promise.all(PROMPTS.map(async (_, i) => await engine.open(`all-${i}`)))
    // Prefill in one call: the two 9-token prompts share a run; 30 > chunkSize runs chunked, alone.
    const first = await engine.stepBatch(PROMPTS.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: p }, positions: range(p.length) })))
    const tokens: number[][] = PROMPTS.map(() => [])
    let worst = 0
    let results = first
    for (let step = 0; ; step++) {
      results.forEach((r, i) => {
        if (!('output' in r)) throw r.error
        const l = logitsOf(r.output)
        worst = Math.max(worst, maxDiff(l, want[i]!.logits[step]!))
        tokens[i]!.push(argmax(l))
      })
      if (step + 1 === TOKENS) break
      results = await engine.stepBatch(seqs.map((seqId, i) => ({ seqId, input: { tokenIds: [tokens[i]!.at(-1)!] }, positions: [PROMPTS[i]!.length + step] })))
    }
    console.log(`stepBatch vs batch-of-one, 5 sequences × ${TOKENS} tokens: max |Δlogit| = ${worst.toExponential(2)}`)
    tokens.forEach((t, i) => { expect(t).toEqual(want[i]!.tokens) })
    const stats = await engine.stats()
    expect(stats.kvBytes).toBe(PROMPTS.reduce((n, p) => n + p.length + TOKENS - 1, 0) * 2 * (stage.layers[1] + 1) * stage.numKvHeads * stage.headDim * 4)
    expect(stats.kvHeldBytes).toBeGreaterThanOrEqual(stats.kvBytes)
    for (const s of seqs) await engine.free(s)
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0, kvHeldBytes: 0 })
  })

  it('sequences join and leave between steps; an aborted member leaves the others exact', async () => {
    // Sequence i starts at step 8·i; sequence 1 is aborted at step 20; the rest run to 64 tokens.
    const active = new Map<number, { seqId: string, tokens: number[], signal: AbortController }>()
    const done = new Map<number, number[]>()
    for (let step = 0; active.size > 0 || done.size + 1 < PROMPTS.length; step++) {
      const items: StageBatchItem[] = []
      const who: number[] = []
      for (let i = 0; i < PROMPTS.length; i++) {
        if (step === 8 * i) {
          active.set(i, { seqId: await engine.open(`jl-${i}`), tokens: [], signal: new AbortController() })
          items.push({ seqId: `jl-${i}`, input: { tokenIds: PROMPTS[i]! }, positions: range(PROMPTS[i]!.length), signal: active.get(i)!.signal.signal })
          who.push(i)
        } else if (active.has(i)) {
          const a = active.get(i)!
          items.push({ seqId: a.seqId, input: { tokenIds: [a.tokens.at(-1)!] }, positions: [PROMPTS[i]!.length + a.tokens.length - 1], signal: a.signal.signal })
          who.push(i)
        }
      }
      if (items.length === 0) continue
      const pending = engine.stepBatch(items)
      if (step === 20) active.get(1)!.signal.abort()
      const results = await pending
      results.forEach((r, j) => {
        const i = who[j]!
        const a = active.get(i)!
        if (i === 1 && a.signal.signal.aborted) {
          expect(r).toMatchObject({ error: { code: 'SHOAL_ERR_ABORTED' } })
          active.delete(i)
          done.set(i, a.tokens)
          return
        }
        if (!('output' in r)) throw r.error
        a.tokens.push(argmax(logitsOf(r.output)))
        if (a.tokens.length === TOKENS) { active.delete(i); done.set(i, a.tokens); void engine.free(a.seqId) }
      })
    }
    for (const [i, t] of done) {
      if (i === 1) expect(t).toEqual(want[1]!.tokens.slice(0, t.length))
      else expect(t).toEqual(want[i]!.tokens)
    }
    expect(done.get(1)!.length).toBeLessThan(TOKENS)
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0, kvHeldBytes: 0 })
  })

  it('members that skip steps, in any order, keep the tokens (right-padded: the logits) they get alone', async () => {
    // Each step a different subset of the five, shuffled: rows move between the shared block's
    // rows, to a block of their own and back (kv-rows.ts), and the block is repacked only when
    // that cannot be done.
    // An engine bounded to the five: its blocks have no row to spare once all five share one, so
    // a sequence that sits a step out in the run's rows moves to a block of its own.
    const tight = await startTinyEngine({ threads: 1, maxSequences: PROMPTS.length, chunkSize: 16 }, model)
    try {
      for (const seed of [11, 12]) await skipping(engine, seed)
      for (const seed of [13, 14, 15]) await skipping(tight.engine, seed)
    } finally {
      await tight.engine.stop() // not tight.stop(): that removes the model the describe shares
    }
  })

  /** The five prompts decoded to TOKENS, each step a pseudo-random subset (from `seed`) in shuffled order, checked against alone. */
  async function skipping (engine: BatchingStageEngine, seed: number): Promise<void> {
    const rand = (n: number): number => { seed = (Math.imul(seed, 1664525) + 1013904223) >>> 0; return (seed >>> 8) % n }
    const live = PROMPTS.map((p, i) => ({ seqId: `skip-${seed}-${i}`, prompt: p, logits: [] as Float32Array[] }))
    for (const l of live) await engine.open(l.seqId)
    await engine.stepBatch(live.map(l => ({ seqId: l.seqId, input: { tokenIds: l.prompt }, positions: range(l.prompt.length) }))).then(rs => rs.forEach((r, i) => {
      if (!('output' in r)) throw r.error
      live[i]!.logits.push(logitsOf(r.output).slice())
    }))
    while (live.some(l => l.logits.length < TOKENS)) {
      const going = live.filter(l => l.logits.length < TOKENS && rand(4) > 0).sort(() => rand(3) - 1)
      const results = await engine.stepBatch(going.map(l => ({ seqId: l.seqId, input: { tokenIds: [argmax(l.logits.at(-1)!)] }, positions: [l.prompt.length + l.logits.length - 1] })))
      results.forEach((r, j) => {
        if (!('output' in r)) throw r.error
        going[j]!.logits.push(logitsOf(r.output).slice())
      })
    }
    live.forEach((l, i) => {
      expect(l.logits.map(x => argmax(x))).toEqual(want[i]!.tokens)
      if (padding === 'right') l.logits.forEach((x, k) => { expect(maxDiff(x, want[i]!.logits[k]!)).toBe(0) })
    })
    for (const l of live) await engine.free(l.seqId)
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0, kvHeldBytes: 0 })
  }

  it('a bad item fails alone and ends only its own sequence', async () => {
    const [a, b] = [await engine.open('bad-a'), await engine.open('bad-b')]
    await engine.stepBatch([{ seqId: a, input: { tokenIds: PROMPTS[0]! }, positions: range(3) }, { seqId: b, input: { tokenIds: PROMPTS[0]! }, positions: range(3) }])
    const r = await engine.stepBatch([
      { seqId: a, input: { tokenIds: [want[0]!.tokens[0]!] }, positions: [3] },
      { seqId: b, input: { tokenIds: [1, 2] }, positions: [3] },
      { seqId: 'nope', input: { tokenIds: [1] }, positions: [0] },
      { seqId: a, input: { tokenIds: [1] }, positions: [4] },
    ])
    expect(r[0]).toHaveProperty('output')
    expect(argmax(logitsOf((r[0] as { output: StepOutput }).output))).toBe(want[0]!.tokens[1])
    expect(r.slice(1).map(x => 'error' in x ? (x.error as { code?: string }).code : 'ok')).toEqual(['SHOAL_ERR_ENGINE', 'SHOAL_ERR_ENGINE', 'SHOAL_ERR_ENGINE'])
    expect(Object.keys((await engine.stats()).sequences)).toEqual([a])
    await engine.free(a)
  })

  it('an aborted batch signal fails every item and drops their KV', async () => {
    const [a, b] = [await engine.open('ab-a'), await engine.open('ab-b')]
    const ctl = new AbortController()
    ctl.abort()
    const r = await engine.stepBatch([{ seqId: a, input: { tokenIds: [1] }, positions: [0] }, { seqId: b, input: { tokenIds: [1] }, positions: [0] }], ctl.signal)
    expect(r).toMatchObject([{ error: { code: 'SHOAL_ERR_ABORTED' } }, { error: { code: 'SHOAL_ERR_ABORTED' } }])
    expect(await engine.stats()).toMatchObject({ liveSequences: 0, kvBytes: 0 })
  })

  it('without left padding (batchPadding none) items run one at a time, bit-identical to single steps', async () => {
    const session = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    try {
      const runner = createStageRunner({ session, stage: { ...stage, batchPadding: 'none' }, chunkSize: 16 })
      const single = createStageRunner({ session, stage, chunkSize: 16 })
      const ids = (p: number[]): BigInt64Array => BigInt64Array.from(p, BigInt)
      const pos = (n: number, from = 0): BigInt64Array => BigInt64Array.from(range(n, from), BigInt)
      PROMPTS.slice(0, 3).forEach((_, i) => { runner.open(`n${i}`); single.open(`n${i}`) })
      const batched = await runner.stepBatch(PROMPTS.slice(0, 3).map((p, i) => ({ seqId: `n${i}`, input: { kind: 'tokens', ids: ids(p) }, positions: pos(p.length), logitsToKeep: 1 })))
      const next = await runner.stepBatch(PROMPTS.slice(0, 3).map((p, i) => ({ seqId: `n${i}`, input: { kind: 'tokens', ids: ids([7]) }, positions: pos(1, p.length), logitsToKeep: 1 })))
      for (const [i, p] of PROMPTS.slice(0, 3).entries()) {
        expect(batched[i]).toEqual({ output: await single.step(`n${i}`, { kind: 'tokens', ids: ids(p) }, pos(p.length), 1) })
        expect(next[i]).toEqual({ output: await single.step(`n${i}`, { kind: 'tokens', ids: ids([7]) }, pos(1, p.length), 1) })
      }
    } finally {
      await session.close()
    }
  })
})
