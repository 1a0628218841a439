/**
 * Speculation on int4 shards. A verify step runs K + 1 positions where plain decoding runs one:
 * with f32 activations greedy tokens stay those of plain decoding, alone and with 4 streams; with
 * int8 activations (the compiler's default) the rounding of a several-position step can pick a
 * different near-tie token (seen on a 250m model), so such a target refuses speculation at start.
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
import { compileShards, generateDraftPair } from '../../shards/index.ts'

const PROMPTS = ['The quick brown fox', 'Once upon a time there', 'abc abc abc abc', 'Hello world, this is']

describe('speculative decoding on int4 shards', () => {
  let dir: string
  let plain: LocalService
  const spec: Record<string, LocalService> = {}
  const counts: SpeculationCounts[] = []
  const reference = new Map<string, number[]>()
  let n = 0
  const req = (svc: LocalService, text: string): GenerateRequest => ({
    requestId: `r${++n}`, model: svc.models()[0]!.id, prompt: { kind: 'text', text }, maxTokens: 48, sampling: { temperature: 0, topP: 1 }, stop: [], deadline: Date.now() + 120_000,
  })
  const tokens = async (svc: LocalService, text: string): Promise<number[]> => {
    const out: number[] = []
    for await (const e of svc.generate(req(svc, text), new AbortController().signal)) if (e.type === 'delta') out.push(...e.tokenIds)
    return out
  }

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'shoal-spec-int4-'))
    const { draftDir, targetDir } = await generateDraftPair({ architecture: 'llama', outDir: join(dir, 'ckpt'), size: 'tiny', draftLayers: 1, extraLayers: 3, epsilon: 0.05 })
    const target = await compileShards({ modelDir: targetDir, outDir: join(dir, 'target'), quant: 'int4', accuracyLevel: 0 })
    expect(target.quantization).toMatchObject({ kind: 'int4', activations: 'f32' })
    await compileShards({ modelDir: targetDir, outDir: join(dir, 'target-int8'), quant: 'int4' })
    // The draft's own format does not matter: its tokens are only proposals.
    await compileShards({ modelDir: draftDir, outDir: join(dir, 'draft'), quant: 'int4' })
    plain = createLocalService({ shardDir: join(dir, 'target'), threads: 1 })
    await plain.start()
    for (const k of [4, 'adaptive'] as const) {
      spec[String(k)] = createLocalService({
        shardDir: join(dir, 'target'),
        threads: 1,
        sourceWrapper: createSpeculation({ drafter: { draftDir: join(dir, 'draft') }, k, threads: 1, onRequestEnd: (_id, c) => counts.push(c) }),
      })
      await spec[String(k)]!.start()
    }
    for (const text of PROMPTS) reference.set(text, await tokens(plain, text))
  })
  afterAll(async () => {
    for (const s of Object.values(spec)) await s.stop()
    await plain?.stop()
    await rm(dir, { recursive: true, force: true })
  })

  it('a target with int8 activations refuses speculation at start (SHOAL_ERR_CONFIG, naming the fix)', async () => {
    const svc = createLocalService({ shardDir: join(dir, 'target-int8'), threads: 1, sourceWrapper: createSpeculation({ drafter: 'prompt-lookup' }) })
    await expect(svc.start()).rejects.toMatchObject({ code: 'SHOAL_ERR_CONFIG', message: expect.stringMatching(/--f32-activations/) })
    await svc.stop()
  })

  for (const k of ['4', 'adaptive']) {
    it(`greedy tokens equal plain decoding (K ${k}), alone and as 4 concurrent streams`, async () => {
      for (const text of PROMPTS) expect(await tokens(spec[k]!, text), text).toEqual(reference.get(text))
      const together = await Promise.all(PROMPTS.map(async text => await tokens(spec[k]!, text)))
      together.forEach((t, i) => { expect(t, `stream ${i}`).toEqual(reference.get(PROMPTS[i]!)) })
      expect(counts.reduce((a, c) => a + c.accepted, 0)).toBeGreaterThan(0)
    })
  }
})
