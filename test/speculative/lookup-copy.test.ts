/**
 * Prompt lookup on a model that copies its prompt: a successor test model (greedy next token =
 * a fixed cycle's next token, see shards/testmodel) and a "rewrite this text with one change"
 * prompt holding a long stretch of that cycle. The model's greedy text follows the cycle (checked
 * by an independent onnxruntime loop); speculation with prompt lookup gives exactly the plain
 * greedy tokens, whole sequence, and — a property of this model, not a timing — most drafts stand,
 * where on a random model almost none do.
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createLocalService } from '../../daemon/engine/index.ts'
import type { LocalService } from '../../daemon/engine/index.ts'
import { createSpeculation } from '../../daemon/speculative/index.ts'
import type { SpeculationCounts } from '../../daemon/speculative/index.ts'
import type { GenerateRequest } from '../../daemon/service.ts'
import { compileShards, copyTaskPrompt, generateTestModel, successorCycle } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { referenceGreedy } from '../engine/reference-greedy.ts'

const TOKENS = 100

let counter = 0
function request (model: string, ids: number[]): GenerateRequest {
  return {
    requestId: `copy#${++counter}`, model, prompt: { kind: 'tokens', ids }, maxTokens: TOKENS,
    sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 120_000,
  }
}

async function tokensOf (svc: LocalService, req: GenerateRequest): Promise<number[]> {
  const out: number[] = []
  for await (const ev of svc.generate(req, new AbortController().signal)) if (ev.type === 'delta') out.push(...ev.tokenIds)
  return out
}

describe('prompt lookup on a model that repeats its prompt', () => {
  let dir: string
  let manifest: ShardManifest
  let shardDir: string
  const cycle = successorCycle('llama', 3)
  const services: Record<string, { svc: LocalService, counts: SpeculationCounts[] }> = {}
  const copy = copyTaskPrompt({ cycle, length: 160, change: 60, prefix: 24, start: 40 })

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'shoal-copy-'))
    await generateTestModel({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: 'tiny', seed: 3, successor: { epsilon: 0.02 } })
    shardDir = join(dir, 'shards')
    manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: shardDir })
    services.plain = { svc: createLocalService({ shardDir, threads: 1 }), counts: [] }
    for (const [name, k] of [['lookup4', 4], ['lookupA', 'adaptive']] as const) {
      const counts: SpeculationCounts[] = []
      // A steady clock (1 ms per reading): adaptive K decides from the same costs on a loaded
      // machine as on an idle one (with the real clock, a busy CI could measure rounds as dear).
      let t = 0
      services[name] = { svc: createLocalService({ shardDir, threads: 1, sourceWrapper: createSpeculation({ drafter: 'prompt-lookup', k, now: () => ++t, onRequestEnd: (_id, c) => counts.push(c) }) }), counts }
    }
    for (const s of Object.values(services)) await s.svc.start()
  })
  afterAll(async () => {
    for (const s of Object.values(services)) await s.svc.stop()
    if (dir !== undefined) await rm(dir, { recursive: true, force: true })
  })

  it('greedy text follows the cycle, past the changed token and past the prompt text', async () => {
    const graph = join(shardDir, ...manifest.stages[0]!.graph.split('/'))
    // 200 tokens: beyond the 160-token text the continuation is nowhere in the prompt, and still the cycle.
    expect(await referenceGreedy(graph, manifest.shape, copy.ids, 200)).toEqual(copy.continuation(200))
    expect(await tokensOf(services.plain!.svc, request(manifest.modelId, copy.ids))).toEqual(copy.continuation(TOKENS))
  })

  it('prompt lookup (K = 4 and adaptive) gives the plain greedy tokens and most of its drafts stand', async () => {
    const want = await tokensOf(services.plain!.svc, request(manifest.modelId, copy.ids))
    for (const name of ['lookup4', 'lookupA']) {
      const { svc, counts } = services[name]!
      expect(await tokensOf(svc, request(manifest.modelId, copy.ids)), name).toEqual(want)
      const c = counts.at(-1)!
      expect(c.drafter).toBe('prompt-lookup')
      // The changed token costs one rejected round; the rest of the text is found in the prompt.
      expect(c.accepted / c.drafted, name).toBeGreaterThan(0.8)
      // Tokens per target step: K = 4 is fixed; adaptive K follows the (steady) step times, so its bound is looser.
      expect((TOKENS - 1) / (c.rounds + c.plainSteps), `${name} tokens per target step`).toBeGreaterThan(name === 'lookup4' ? 2.5 : 1.5)
    }
  })
})
