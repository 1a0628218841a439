/**
 * A local chain on static graphs (what `shoal serve --device cpu,NPU` runs where a stage is on an
 * NPU; here every stage is told to use them on onnxruntime CPU): the greedy tokens of the unsplit
 * dynamic graph, and the chain's context limit is the KV budget — a completion ends with 'length'
 * there instead of failing in a stage.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalChain } from '../../daemon/pipeline/index.ts'
import type { GenerateEvent } from '../../daemon/service.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import { referenceGreedy } from '../engine/reference-greedy.ts'

const CTX = 40
let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-static-chain-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

describe('local chain on static graphs', () => {
  it('gives the unsplit dynamic graph\'s greedy tokens up to the KV budget, then ends with length', async () => {
    const ckpt = join(root, 'ckpt')
    await generateTestModel({ architecture: 'llama', outDir: ckpt, size: 'tiny', seed: 4 })
    const whole = await compileShards({ modelDir: ckpt, outDir: join(root, 'whole'), modelId: 'static-chain' })
    await compileShards({ modelDir: ckpt, outDir: join(root, 'two'), modelId: 'static-chain', stages: 2, static: { contextLength: CTX, chunk: 4 } })
    const chain = createLocalChain({ shardDir: join(root, 'two'), engines: [{ backend: 'onnxruntime', device: 'CPU' }], graphs: 'static', threads: 1, kvCacheBytes: 1 << 20 })
    await chain.start()
    try {
      expect(chain.service.models()[0]!.contextLength).toBe(CTX)
      // Static graphs keep no prefixes (their caches are not left-aligned): reuse stays off.
      expect(chain.service.stats().prefix).toBeUndefined()
      const events: GenerateEvent[] = []
      for await (const ev of chain.service.generate({
        requestId: 'c1', model: 'static-chain', prompt: { kind: 'text', text: 'The quick brown fox jumps over the lazy dog' }, maxTokens: undefined,
        sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 60_000,
      }, new AbortController().signal)) events.push(ev)
      const start = events[0] as Extract<GenerateEvent, { type: 'start' }>
      const got = events.flatMap(e => e.type === 'delta' ? e.tokenIds : [])
      const want = await referenceGreedy(join(root, 'whole', ...whole.stages[0]!.graph.split('/')), whole.shape, start.promptTokenIds, CTX - start.promptTokenIds.length)
      const eos = whole.generation.eosTokenIds
      const cut = want.findIndex(t => eos.includes(t))
      expect(got).toEqual(cut < 0 ? want : want.slice(0, cut + 1))
      if (cut < 0) expect(events.at(-1)).toMatchObject({ type: 'end', finishReason: 'length', usage: { completionTokens: CTX - start.promptTokenIds.length } })
    } finally {
      await chain.stop()
    }
  })
})
