/**
 * Speculative decoding across a chain of int4 shards with int8 activations (the compiler's
 * default) on shoal's kernels: every stage computes a verify position by position as it decodes
 * (the verify attention; a stage without a head is told a step is a verify by the positions it
 * keeps, engine/native/swap.ts), so a speculating request's greedy tokens are the chain's plain
 * ones bit for bit. Real libp2p nodes on loopback and real onnxruntime sessions. A coordinator
 * speculates only over chains whose every stage advertises the kernels (int4 and verify); where
 * the only holder of a stage lacks them, the request decodes plainly, with the same tokens; a
 * stage killed mid-verify is replayed on another holder with the kernels, never on one without,
 * unless none is left: then a greedy request goes on plainly over one without, and a seeded
 * sampled one ends with a chain error. The default lookup never moves a request onto a dearer
 * chain for the kernels: it speculates where the chain it takes anyway runs them.
 * Skipped where the kernels cannot be built (no `cc`, or off x86-64 Linux).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { kernelsApplying, prepareNativeKernels } from '../../daemon/engine/index.ts'
import { hasCompiler } from '../../daemon/engine/native/build.ts'
import { createPipelineService } from '../../daemon/pipeline/index.ts'
import type { PipelineService, PipelineServiceInit } from '../../daemon/pipeline/index.ts'
import type { StageHolder } from '../../daemon/routing/index.ts'
import { createSpeculation, exactVerifyNeeds } from '../../daemon/speculative/index.ts'
import type { SpeculationCounts, SpeculationInit } from '../../daemon/speculative/index.ts'
import type { GenerateEvent, GenerateRequest } from '../../daemon/service.ts'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { holderOf, kill, startStage, stopHost } from '../pipeline/fixture.ts'
import type { StageHost } from '../pipeline/fixture.ts'
import { killingDrafter } from './killing-drafter.ts'

const kernelHere = process.platform === 'linux' && process.arch === 'x64' && await hasCompiler()

// Text that repeats, so prompt lookup has drafts to verify; and text that does not.
const PROMPTS = ['abc abc abc abc abc abc abc abc', 'the cat sat on the mat. the cat sat on the mat. the cat', 'Once upon a time']
const TOKENS = 40

describe.skipIf(!kernelHere)('speculation on a chain of int8-activation int4 shards, on shoal\'s kernels', () => {
  let root: string
  let lib: string
  let manifest: ShardManifest
  let kernels: string[]
  const hosts: StageHost[] = []
  let first: StageHost
  let last: StageHost
  let lastPlain: StageHost
  let spare: StageHost
  let plain: PipelineService
  let spec: PipelineService
  /** Each coordinator's holders of the last stage (switched by the tests). */
  let lastHolders: StageHolder[] = []
  let plainHolders: StageHolder[] = []
  const counts: SpeculationCounts[] = []
  let n = 0
  const request = (text: string, sampling: GenerateRequest['sampling'] = { temperature: 0, topP: 1 }): GenerateRequest => ({
    requestId: `r${++n}`, model: manifest.modelId, prompt: { kind: 'text', text }, maxTokens: TOKENS, sampling, stop: [], deadline: Date.now() + 120_000,
  })
  /** A started coordinator on stage 0 over `lastHolders`, speculating with `speculation` over chains of stages that run the kernels. */
  const speculating = async (speculation: SpeculationInit, over: Partial<PipelineServiceInit> = {}): Promise<PipelineService> => {
    const svc = createPipelineService({
      stage: first.stage,
      shardDir: join(root, 'shard'),
      sourceWrapper: createSpeculation({ targetKernels: kernels, ...speculation }),
      speculationKernels: exactVerifyNeeds(manifest)!,
      kernels,
      ...over,
    }, { holders: () => lastHolders })
    await svc.start()
    return svc
  }
  const tokensOf = async (svc: PipelineService, text: string, sampling?: GenerateRequest['sampling']): Promise<number[]> => {
    const out: number[] = []
    for await (const e of svc.generate(request(text, sampling), new AbortController().signal) as AsyncIterable<GenerateEvent>) if (e.type === 'delta') out.push(...e.tokenIds)
    return out
  }

  beforeAll(async () => {
    root = await mkdtemp(join(tmpdir(), 'shoal-chain-int4-'))
    const prepared = await prepareNativeKernels(join(root, 'kernels'))
    if (!('lib' in prepared)) throw new Error(`the kernels did not build here: ${prepared.off}`)
    lib = prepared.lib
    await generateTestModel({ architecture: 'llama', outDir: join(root, 'ckpt'), size: 'small', seed: 7 })
    manifest = await compileShards({ modelDir: join(root, 'ckpt'), outDir: join(root, 'shard'), quant: 'int4', stages: 2 })
    expect(manifest.quantization).toMatchObject({ kind: 'int4' })
    expect(exactVerifyNeeds(manifest)).toEqual(['int4', 'verify'])
    kernels = kernelsApplying(manifest)
    expect(kernels).toEqual(['int4', 'attention', 'verify'])
    const dir = join(root, 'shard')
    const [a, b] = manifest.stages.map(st => st.layers)
    first = await startStage(dir, a!, { kernels: prepared.lib })
    last = await startStage(dir, b!, { kernels: prepared.lib })
    lastPlain = await startStage(dir, b!)
    spare = await startStage(dir, b!, { kernels: prepared.lib })
    hosts.push(first, last, lastPlain, spare)
    plain = createPipelineService({ stage: first.stage, shardDir: dir }, { holders: () => plainHolders })
    await plain.start()
    spec = await speculating({ drafter: 'prompt-lookup', k: 4, onRequestEnd: (_id, c) => counts.push(c) })
  }, 240_000)
  afterAll(async () => {
    await spec?.stop()
    await plain?.stop()
    for (const h of hosts) await stopHost(h).catch(() => {})
    if (root !== undefined) await rm(root, { recursive: true, force: true })
  })

  it('speculates over a chain whose every stage verifies on the kernels, with the plain chain\'s greedy tokens', async () => {
    lastHolders = [{ ...holderOf(last), kernels }, { ...holderOf(lastPlain), rttMs: 0 }]
    plainHolders = [{ ...holderOf(last), kernels }]
    counts.length = 0
    for (const text of PROMPTS) expect(await tokensOf(spec, text), text).toEqual(await tokensOf(plain, text))
    expect(counts).toHaveLength(PROMPTS.length)
    expect(counts.reduce((a, c) => a + c.accepted, 0)).toBeGreaterThan(0)
    expect(counts.reduce((a, c) => a + c.rounds, 0)).toBeGreaterThan(0)
  }, 240_000)

  it('decodes plainly, with the same tokens, where the only holder of a stage lacks the kernels', async () => {
    // Its tokens are onnxruntime's int4 products' there (not the kernels' bits): the reference is the plain chain over it.
    lastHolders = [holderOf(lastPlain)]
    plainHolders = [holderOf(lastPlain)]
    counts.length = 0
    for (const text of PROMPTS.slice(0, 2)) expect(await tokensOf(spec, text), text).toEqual(await tokensOf(plain, text))
    expect(counts).toEqual([])
  }, 240_000)

  it('by default, speculates only where the chain it would take anyway runs the kernels: it never moves a request', async () => {
    const own: SpeculationCounts[] = []
    const byDefault = await speculating({ drafter: 'prompt-lookup', byDefault: true, onRequestEnd: (_id, c) => own.push(c) }, { speculationSteers: false })
    const routeOf = async (text: string): Promise<{ route: string[], tokens: number[] }> => {
      const out = { route: [] as string[], tokens: [] as number[] }
      for await (const e of byDefault.generate(request(text), new AbortController().signal) as AsyncIterable<GenerateEvent>) {
        if (e.type === 'start') out.route = e.route
        if (e.type === 'delta') out.tokens.push(...e.tokenIds)
      }
      return out
    }
    try {
      const text = PROMPTS[0]!
      // The holder without the kernels is the cheaper: the request goes there, plainly.
      lastHolders = [{ ...holderOf(last), kernels, rttMs: 40 }, { ...holderOf(lastPlain), rttMs: 0 }]
      plainHolders = [holderOf(lastPlain)]
      const plainly = await routeOf(text)
      expect(plainly.route).toEqual([first.stage.node.peerId, lastPlain.stage.node.peerId])
      expect(plainly.tokens).toEqual(await tokensOf(plain, text))
      expect(own).toEqual([])
      // The kernel holder is the cheaper: it goes there, and speculates.
      lastHolders = [{ ...holderOf(last), kernels, rttMs: 0 }, { ...holderOf(lastPlain), rttMs: 40 }]
      plainHolders = [{ ...holderOf(last), kernels }]
      const speculating = await routeOf(text)
      expect(speculating.route).toEqual([first.stage.node.peerId, last.stage.node.peerId])
      expect(speculating.tokens).toEqual(await tokensOf(plain, text))
      expect(own).toHaveLength(1)
      expect(own[0]!.drafted).toBeGreaterThan(0)
    } finally {
      await byDefault.stop()
    }
  }, 240_000)

  it('replays a verify whose stage was killed on another holder with the kernels, with the same tokens', async () => {
    const text = PROMPTS[1]!
    plainHolders = [{ ...holderOf(last), kernels }]
    const reference = await tokensOf(plain, text)
    // The kernel holders first by cost, then the one without them (cheapest, never chosen).
    lastHolders = [{ ...holderOf(last), kernels, rttMs: 1 }, { ...holderOf(spare), kernels, rttMs: 40 }, { ...holderOf(lastPlain), rttMs: 0 }]
    // Prompt lookup that kills the last stage right after its 3rd proposal: that verify meets a dead stage.
    const killing = killingDrafter(3, async () => { await kill(last) })
    const replaying = await speculating({ drafter: killing, k: 3 })
    const sentBefore = [spare, lastPlain].map(h => h.stage.node.stats().bytesSent)
    try {
      expect(await tokensOf(replaying, text)).toEqual(reference)
      expect(killing.proposals()).toBeGreaterThanOrEqual(3)
      // The replay ran on the spare (it sent verdicts and tokens back), not on the holder without the kernels.
      const sent = [spare, lastPlain].map((h, i) => h.stage.node.stats().bytesSent - sentBefore[i]!)
      expect(sent[0]).toBeGreaterThan(0)
      expect(sent[1]).toBe(0)
    } finally {
      await replaying.stop()
    }
  }, 240_000)

  it('goes on plainly over a holder without the kernels when the killed stage was the last one with them', async () => {
    const text = PROMPTS[0]!
    plainHolders = [{ ...holderOf(spare), kernels }]
    const reference = await tokensOf(plain, text)
    plainHolders = [holderOf(lastPlain)]
    const onPlainHolder = await tokensOf(plain, text)
    lastHolders = [{ ...holderOf(spare), kernels, rttMs: 1 }, { ...holderOf(lastPlain), rttMs: 40 }]
    const killing = killingDrafter(3, async () => { await kill(spare) })
    const own: SpeculationCounts[] = []
    const replaying = await speculating({ drafter: killing, k: 3, onRequestEnd: (_id, c) => own.push(c) })
    const sentBefore = lastPlain.stage.node.stats().bytesSent
    try {
      const got = await tokensOf(replaying, text)
      expect(killing.proposals()).toBeGreaterThanOrEqual(3)
      expect(got).toHaveLength(TOKENS)
      // The replay and the rest ran on the holder without the kernels.
      expect(lastPlain.stage.node.stats().bytesSent - sentBefore).toBeGreaterThan(0)
      expect(own).toHaveLength(1)
      // The first tokens came from the kernels' chain, the rest from onnxruntime's products: where
      // the two plain chains agree on this text (they differ by at most a near tie's rounding), so does it.
      if (reference.join() === onPlainHolder.join()) expect(got).toEqual(reference)
    } finally {
      await replaying.stop()
    }
  }, 240_000)

  it('ends a seeded sampled request with a chain error there instead: plain steps would draw differently', async () => {
    const extra = await startStage(join(root, 'shard'), manifest.stages[1]!.layers, { kernels: lib })
    hosts.push(extra)
    lastHolders = [{ ...holderOf(extra), kernels, rttMs: 1 }, { ...holderOf(lastPlain), rttMs: 40 }]
    const killing = killingDrafter(3, async () => { await kill(extra) })
    const replaying = await speculating({ drafter: killing, k: 3 })
    try {
      await expect(tokensOf(replaying, PROMPTS[0]!, { temperature: 0.8, topP: 1, seed: 5 })).rejects.toThrow(/no node running shoal's kernels int4, verify holds layers/)
      expect(killing.proposals()).toBeGreaterThanOrEqual(3)
    } finally {
      await replaying.stop()
    }
  }, 240_000)
})
