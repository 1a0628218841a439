/**
 * Batch invariance of quantized shards: an int4 model compiled with the default accuracy level
 * (f32 activations) gives every sequence of a ragged, left-padded batch exactly the greedy tokens
 * it gets alone, over whole 64-token sequences. (With `accuracyLevel: 4` — int8 activations — the
 * same check fails at tokens 31 and 33 of two sequences: the activation quantization amplifies the
 * padded attention's last-bit differences. That is why 4 is opt-in.) The `small` generated model is
 * used because the tiny one's margins are too wide to show the difference.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createStageEngine, stageInfoOf } from '../../daemon/engine/index.ts'
import type { BatchingStageEngine, StepOutput } from '../../daemon/engine/index.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'

const TOKENS = 64
const GREEDY = { temperature: 0, topP: 1, u: 0 }
const prompts = [16, 17, 19, 23].map((n, i) => Array.from({ length: n }, (_, j) => 1 + ((i * 131 + j * 37) % 500)))
const tokenOf = (out: StepOutput): number => {
  if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
  return out.id
}

describe('int4 shards (default accuracy level) under batching', () => {
  let root: string
  let engine: BatchingStageEngine

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-int4-batch-'))
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small' })
    const manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4' })
    engine = createStageEngine({ graphPath: join(root, 'shard', ...manifest.stages[0]!.graph.split('/')), stage: stageInfoOf(manifest), threads: 1, maxSequences: 8 })
    await engine.start()
  }, 120_000)
  afterAll(async () => {
    await engine?.stop()
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('a ragged batch of four gives each sequence its batch-of-one greedy tokens, over 64 tokens', async () => {
    const alone: number[][] = []
    for (const p of prompts) {
      const seq = await engine.open()
      let t = tokenOf(await engine.step(seq, { tokenIds: p }, p.map((_, i) => i), { pick: GREEDY }))
      const ids = [t]
      while (ids.length < TOKENS) {
        t = tokenOf(await engine.step(seq, { tokenIds: [t] }, [p.length + ids.length - 1], { pick: GREEDY }))
        ids.push(t)
      }
      alone.push(ids)
      await engine.free(seq)
    }
    const seqs = await Promise.all(prompts.map(async (_, i) => await engine.open(`b-${i}`)))
    const together: number[][] = prompts.map(() => [])
    let items = prompts.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: p }, positions: p.map((_, k) => k), pick: GREEDY }))
    for (let step = 0; step < TOKENS; step++) {
      const results = await engine.stepBatch(items)
      results.forEach((r, i) => {
        if (!('output' in r)) throw r.error
        together[i]!.push(tokenOf(r.output))
      })
      items = prompts.map((p, i) => ({ seqId: seqs[i]!, input: { tokenIds: [together[i]!.at(-1)!] }, positions: [p.length + step], pick: GREEDY }))
    }
    for (const s of seqs) await engine.free(s)
    expect(together).toEqual(alone)
  }, 120_000)
})
