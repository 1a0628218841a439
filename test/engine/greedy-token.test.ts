/**
 * A step whose rows are all greedy fetches the graph's greedy_token (TopK k = 1 over the logits,
 * compiler ≥ 10) instead of the logits, and gets the very tokens the logits' argmax gives: alone
 * over a chunked prefill and 40 decode steps, in a batch of four, and in a batch that mixes a
 * sampled row with greedy ones (which fetches the logits for all). Also the op's tie and NaN rule,
 * the JS argmax's, on a graph of TopK alone.
 */
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { argmax, createOnnxruntimeBackend, createStageRunner, GREEDY_PICK as GREEDY, pickToken, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BackendSession, PrefixKeepingRunner, TensorMap } from '../../daemon/engine/index.ts'
import { GREEDY_TOKEN, LOGITS, NEW_KV } from '../../shards/contract.ts'
import { DT, GraphBuilder } from '../../shards/graph/builder.ts'
import { greedyByLogits, positions, tokenOf } from './greedy-batches.ts'
import { buildTinyModel } from './tiny-model.ts'
import type { TinyModel } from './tiny-model.ts'

const ids = (n: number, salt: number): bigint[] => Array.from({ length: n }, (_, i) => BigInt((i * 37 + salt * 101 + 5) % 500))

describe('greedy steps fetch the graph\'s greedy token', () => {
  let model: TinyModel
  let runner: PrefixKeepingRunner
  const fetched: Array<readonly string[] | undefined> = []

  beforeAll(async () => {
    model = await buildTinyModel('llama')
    const real = await createOnnxruntimeBackend().load(model.graphPath, { device: 'CPU', threads: 1 })
    const session: BackendSession = { ...real, async run (feeds, fetches): Promise<TensorMap> { fetched.push(fetches); return await real.run(feeds, fetches) } }
    runner = createStageRunner({ session, stage: stageInfoOf(model.manifest), chunkSize: 8 })
    expect(session.outputNames).toContain(GREEDY_TOKEN)
  })
  afterAll(async () => { await model?.cleanup() })

  const byLogits = async (seqId: string, prompt: bigint[], steps: number): Promise<number[]> => await greedyByLogits(runner, seqId, prompt, steps)

  it('alone: a chunked prefill and 40 decode steps give the logits\' argmax, fetching no logits', async () => {
    const prompt = ids(30, 1) // chunks of 8, 8, 8, 6
    const want = await byLogits('ref', prompt, 40)
    expect(fetched.at(-1)).toEqual([LOGITS, NEW_KV])
    runner.open('g')
    const from = fetched.length
    let t = tokenOf(await runner.step('g', { kind: 'tokens', ids: BigInt64Array.from(prompt) }, positions(0, prompt.length), 1, GREEDY))
    const got = [t]
    for (let k = 1; k < 40; k++) {
      t = tokenOf(await runner.step('g', { kind: 'tokens', ids: BigInt64Array.of(BigInt(t)) }, positions(prompt.length + k - 1, 1), 1, GREEDY))
      got.push(t)
    }
    await runner.drop('g', 'free')
    expect(got).toEqual(want)
    expect(fetched.slice(from).every(f => f?.[0] === GREEDY_TOKEN && !f.includes(LOGITS))).toBe(true)
  })

  it('batched: all-greedy batches fetch tokens, a batch with a sampled row fetches logits, and every greedy row keeps its tokens', async () => {
    const prompts = [ids(3, 2), ids(9, 3), ids(17, 4), ids(5, 5)]
    const want: number[][] = []
    for (const [i, p] of prompts.entries()) want.push(await byLogits(`ref${i}`, p, 24))
    const got: number[][] = prompts.map(() => [])
    for (const [i, p] of prompts.entries()) {
      runner.open(`b${i}`)
      got[i]!.push(tokenOf(await runner.step(`b${i}`, { kind: 'tokens', ids: BigInt64Array.from(p) }, positions(0, p.length), 1, GREEDY)))
    }
    // Row 3 samples at temperature 1 on steps 8–15, with top-p 0 (the nucleus is its most likely
    // token alone, so its sequence stays the reference's): those batches fetch the logits.
    for (let k = 1; k < 24; k++) {
      const sampled = k >= 8 && k < 16
      const from = fetched.length
      const res = await runner.stepBatch(prompts.map((p, i) => ({
        seqId: `b${i}`,
        input: { kind: 'tokens' as const, ids: BigInt64Array.of(BigInt(got[i]!.at(-1)!)) },
        positions: positions(p.length + k - 1, 1),
        logitsToKeep: 1,
        pick: sampled && i === 3 ? { temperature: 1, topP: 0, u: 0.5 } : GREEDY,
      })))
      expect(fetched.length).toBe(from + 1)
      expect(fetched.at(-1)![0]).toBe(sampled ? LOGITS : GREEDY_TOKEN)
      for (const [i, r] of res.entries()) {
        if (!('output' in r)) throw r.error
        got[i]!.push(tokenOf(r.output))
      }
    }
    for (const i of prompts.keys()) await runner.drop(`b${i}`, 'free')
    expect(got).toEqual(want)
  })
})

describe('TopK k = 1 takes a tie\'s lowest index, and a NaN only at index 0, as argmax does', () => {
  it('agrees with argmax on ties, NaN (at index 0 too), −∞ and all-equal rows', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'shoal-topk-'))
    try {
      const V = 64
      const g = new GraphBuilder('t.data')
      const x = g.input('x', DT.FLOAT, ['B', V])
      const [, index] = g.node('TopK', '/t', [x, g.i64([1])], { axis: -1, largest: 1, sorted: 1 }, 2) as [string, string]
      g.output('y', index, DT.INT64, ['B', 1])
      await writeFile(join(dir, 't.data'), Buffer.concat(g.data()))
      await writeFile(join(dir, 't.onnx'), g.encode('t', 'TopK alone'))
      const rows: number[][] = [
        Array.from({ length: V }, (_, i) => (i === 5 || i === 40 ? 3 : 0)), // a tie
        Array.from({ length: V }, (_, i) => (i === 7 ? NaN : i === 10 || i === 11 ? 2 : -1)), // NaN before the max
        Array.from({ length: V }, (_, i) => (i < 3 ? NaN : -Infinity)), // NaN and −∞ only
        Array.from({ length: V }, () => 0.5), // all equal
        Array.from({ length: V }, (_, i) => Math.sin(i * 1.7)),
        Array.from({ length: V }, (_, i) => (i === 0 ? NaN : i)), // NaN at index 0: the scan never leaves it
      ]
      const session = await createOnnxruntimeBackend().load(join(dir, 't.onnx'), { device: 'CPU', threads: 1 })
      const out = await session.run({ x: { type: 'float32', data: Float32Array.from(rows.flat()), dims: [rows.length, V] } })
      await session.close()
      const want = rows.map(r => argmax(Float32Array.from(r)))
      expect(Array.from(out.y!.data as BigInt64Array, Number)).toEqual(want)
      expect(want.slice(0, 4)).toEqual([5, 10, 0, 0])
      expect(want[5]).toBe(0)
      expect(pickToken(Float32Array.from(rows[0]!), GREEDY)).toBe(5)
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
  })
})
