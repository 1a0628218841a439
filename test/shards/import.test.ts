/**
 * Checkpoint import: rope scaling, weight dtypes, index-sharded safetensors, tied and separate
 * heads (each checked token-for-token against the float64 reference, through a 2-stage split),
 * generation defaults, the generated tokenizer and chat template, and typed errors.
 */
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { Tokenizer } from '@huggingface/tokenizers'
import { Template } from '@huggingface/jinja'
import { compileShards, generateTestModel, invFreqAt, normalizeConfig, type GenerateOptions } from '../../shards/index.ts'
import { ReferenceModel } from '../support/reference.ts'
import { greedyDecode, openPipeline, prefill } from './pipeline.ts'

let root: string
beforeAll(async () => { root = await mkdtemp(join(tmpdir(), 'shoal-import-')) })
afterAll(async () => { await rm(root, { recursive: true, force: true }) })

const N = 64
let n = 0

async function matchesReference (gen: Omit<GenerateOptions, 'outDir'>, stages = 2, opSet: 'standard' | 'ort-contrib' = 'standard'): Promise<void> {
  const dir = join(root, `m${n++}`)
  await generateTestModel({ seed: 4, ...gen, outDir: dir })
  const prompt = [1, 2, 3, 40, 50, 60, 70]
  const ref = new ReferenceModel(dir).greedy(prompt, N)
  const m = await compileShards({ modelDir: dir, outDir: `${dir}-shards`, stages, opSet })
  expect(m.opSet).toBe(opSet)
  const p = await openPipeline(`${dir}-shards`, m)
  try {
    expect((await greedyDecode(p, prompt, N)).tokens).toEqual(ref.tokens)
  } finally {
    await p.release()
  }
}

describe('import variants match the float64 reference for 64 greedy tokens', () => {
  it('llama3 rope scaling', async () => {
    await matchesReference({ architecture: 'llama', ropeScaling: { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64 } })
  })
  it('linear rope scaling', async () => {
    await matchesReference({ architecture: 'llama', ropeScaling: { type: 'linear', factor: 4 } })
  })
  it('F16 weights in an index-sharded checkpoint', async () => {
    await matchesReference({ architecture: 'qwen2', dtype: 'F16', weightShards: 3 })
  })
  it('BF16 weights', async () => {
    await matchesReference({ architecture: 'phi3', dtype: 'BF16' }, 3)
  })
  it('the ort-contrib op table (SimplifiedLayerNormalization)', async () => {
    await matchesReference({ architecture: 'qwen3' }, 2, 'ort-contrib')
  })
  it('tied llama and untied qwen3', async () => {
    await matchesReference({ architecture: 'llama', tieWordEmbeddings: true })
    await matchesReference({ architecture: 'qwen3', tieWordEmbeddings: false }, 1)
  })
})

describe('config normalisation', () => {
  it('llama3 scaling leaves high frequencies and divides low ones by the factor', () => {
    const base = { architectures: ['LlamaForCausalLM'], hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 4, intermediate_size: 8, vocab_size: 8 }
    const plain = normalizeConfig(base).rotary.invFreq
    const scaled = normalizeConfig({ ...base, rope_scaling: { rope_type: 'llama3', factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 64 } }).rotary.invFreq
    expect(scaled[0]).toBe(plain[0])
    expect(scaled[7]).toBeCloseTo(plain[7]! / 8, 12)
    const linear = normalizeConfig({ ...base, rope_scaling: { type: 'linear', factor: 2 } }).rotary.invFreq
    linear.forEach((f, i) => expect(f).toBeCloseTo(plain[i]! / 2, 15))
  })

  it('yarn (Qwen2.5 long-context): the ramp between beta_fast and beta_slow, mscale on cos/sin', () => {
    // Qwen2.5-7B-Instruct's documented block: head_dim 128, θ 1e6, factor 4 over 32768.
    const base = { architectures: ['Qwen2ForCausalLM'], hidden_size: 3584, num_hidden_layers: 1, num_attention_heads: 28, num_key_value_heads: 4, intermediate_size: 8, vocab_size: 8, rope_theta: 1e6, max_position_embeddings: 32768 }
    const plain = normalizeConfig(base).rotary
    const { rotary } = normalizeConfig({ ...base, rope_scaling: { type: 'yarn', factor: 4, original_max_position_embeddings: 32768 } })
    expect(plain.scale).toBe(1)
    expect(rotary.scale).toBeCloseTo(0.1 * Math.log(4) + 1, 15)
    expect(rotary.long).toBeUndefined()
    // Correction range: floor(128·ln(32768 / (32·2π)) / (2 ln 1e6)) = 23, ceil(… / (1·2π) …) = 40.
    for (let i = 0; i <= 23; i++) expect(rotary.invFreq[i]).toBe(plain.invFreq[i])
    for (let i = 40; i < 64; i++) expect(rotary.invFreq[i]).toBeCloseTo(plain.invFreq[i]! / 4, 18)
    const mid = (31 - 23) / (40 - 23)
    expect(rotary.invFreq[31]).toBeCloseTo(plain.invFreq[31]! / 4 * mid + plain.invFreq[31]! * (1 - mid), 18)
    // DeepSeek's mscale / mscale_all_dim ratio, and an explicit attention_factor.
    const ds = (extra: Record<string, unknown>): number => normalizeConfig({ ...base, rope_scaling: { rope_type: 'yarn', factor: 40, original_max_position_embeddings: 4096, ...extra } }).rotary.scale
    expect(ds({ mscale: 1, mscale_all_dim: 1 })).toBe(1)
    expect(ds({ mscale: 1, mscale_all_dim: 0.5 })).toBeCloseTo((0.1 * Math.log(40) + 1) / (0.05 * Math.log(40) + 1), 15)
    expect(ds({ attention_factor: 0.5 })).toBe(0.5)
  })

  it('longrope (Phi-3.5-mini): short factors below original_max_position_embeddings, long from it, sqrt(1 + ln s / ln orig)', () => {
    const half = 48
    const short = Array.from({ length: half }, (_, i) => 1 + i / 100)
    const long = Array.from({ length: half }, (_, i) => 1 + i)
    const cfg = { architectures: ['Phi3ForCausalLM'], hidden_size: 3072, num_hidden_layers: 1, num_attention_heads: 32, intermediate_size: 8, vocab_size: 8, max_position_embeddings: 131072, original_max_position_embeddings: 4096 }
    const plain = normalizeConfig(cfg).rotary
    const { rotary } = normalizeConfig({ ...cfg, rope_scaling: { type: 'longrope', short_factor: short, long_factor: long } })
    expect(rotary.scale).toBeCloseTo(Math.sqrt(17 / 12), 15) // s = 131072 / 4096 = 32
    expect(rotary.long?.from).toBe(4096)
    rotary.invFreq.forEach((f, i) => expect(f).toBeCloseTo(plain.invFreq[i]! / short[i]!, 14))
    rotary.long!.invFreq.forEach((f, i) => expect(f).toBeCloseTo(plain.invFreq[i]! / long[i]!, 14))
    expect(invFreqAt(rotary, 4095)).toBe(rotary.invFreq)
    expect(invFreqAt(rotary, 4096)).toBe(rotary.long!.invFreq)
    expect(() => normalizeConfig({ ...cfg, rope_scaling: { type: 'longrope', short_factor: short.slice(1), long_factor: long } }))
      .toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CHECKPOINT', message: expect.stringContaining('short_factor') }))
  })

  it('unknown architectures and rope types are typed errors naming what is supported', () => {
    let err: any
    try { normalizeConfig({ architectures: ['GPT2LMHeadModel'] }) } catch (e) { err = e }
    expect(err.code).toBe('SHOAL_ERR_UNSUPPORTED_ARCHITECTURE')
    expect(err.name).toBe('UnsupportedArchitectureError')
    for (const a of ['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Phi3ForCausalLM']) expect(err.message).toContain(a)
    expect(() => normalizeConfig({ architectures: ['LlamaForCausalLM'], hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 4, intermediate_size: 8, vocab_size: 8, rope_scaling: { rope_type: 'dynamic', factor: 4 } }))
      .toThrow(expect.objectContaining({ code: 'SHOAL_ERR_CHECKPOINT', message: expect.stringContaining('longrope') }))
  })

  it('compiling an unknown architecture fails with the typed error', async () => {
    const dir = join(root, 'gpt2')
    await generateTestModel({ architecture: 'llama', outDir: dir })
    const cfg = JSON.parse(await readFile(join(dir, 'config.json'), 'utf8'))
    await writeFile(join(dir, 'config.json'), JSON.stringify({ ...cfg, architectures: ['GPT2LMHeadModel'], model_type: 'gpt2' }))
    await expect(compileShards({ modelDir: dir, outDir: join(root, 'gpt2-out') })).rejects.toMatchObject({ code: 'SHOAL_ERR_UNSUPPORTED_ARCHITECTURE' })
  })
})

describe('tokenizer, chat template and generation defaults', () => {
  it('writes tokenizers that @huggingface/tokenizers loads and round-trips, and templates jinja renders', async () => {
    const expectations = {
      llama: { bos: '<s>', eos: ['</s>'], addBos: true, chat: '[INST] ' },
      qwen2: { bos: undefined, eos: ['<|endoftext|>', '<|im_end|>'], addBos: false, chat: '<|im_start|>user\n' },
      qwen3: { bos: undefined, eos: ['<|endoftext|>', '<|im_end|>'], addBos: false, chat: '<|im_start|>user\n' },
      phi3: { bos: '<s>', eos: ['<|endoftext|>', '<|assistant|>', '<|end|>'], addBos: false, chat: '<|user|>\n' },
    } as const
    for (const [arch, ex] of Object.entries(expectations)) {
      const dir = join(root, `tok-${arch}`)
      await generateTestModel({ architecture: arch as 'llama', outDir: dir })
      const tj = JSON.parse(await readFile(join(dir, 'tokenizer.json'), 'utf8'))
      const tc = JSON.parse(await readFile(join(dir, 'tokenizer_config.json'), 'utf8'))
      const tok = new Tokenizer(tj, tc)
      const text = 'Hello, the quick brown fox! 42 ünïcödé'
      const ids = tok.encode(text, { add_special_tokens: false }).ids
      expect(ids.length).toBeLessThan(Buffer.byteLength(text))
      expect(tok.decode(ids)).toBe(text)
      const withSpecial = tok.encode(text).ids
      const idOf = (t: string): number => tok.token_to_id(t)!
      if (ex.bos !== undefined && ex.addBos) expect(withSpecial[0]).toBe(idOf(ex.bos))
      else expect(withSpecial).toEqual(ids)
      const rendered = new Template(tc.chat_template).render({
        messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: 'Hi' }],
        add_generation_prompt: true, bos_token: tc.bos_token ?? '', eos_token: tc.eos_token,
      })
      expect(rendered).toContain(ex.chat)
      expect(rendered).toContain('Hi')
      const m = await compileShards({ modelDir: dir, outDir: `${dir}-shards` })
      expect(m.generation.eosTokenIds).toEqual(ex.eos.map(idOf).sort((a, b) => a - b))
      expect(m.generation.addBosToken).toBe(ex.addBos)
      expect(m.generation.bosTokenId).toBe(ex.bos === undefined ? undefined : idOf(ex.bos))
      expect(m.generation.tokenizerAddsBos).toBe(ex.addBos)
      expect(m.tokenizerFiles.map(f => f.path).sort()).toEqual(['generation_config.json', 'special_tokens_map.json', 'tokenizer.json', 'tokenizer_config.json'])
      expect(m.description).toMatch(/random weights/)
    }
  })
})

describe('graph I/O semantics', () => {
  it('num_logits_to_keep 0 keeps all positions; left padding is just mask zeros (standard op table)', async () => {
    const dir = join(root, 'io')
    await generateTestModel({ architecture: 'qwen2', outDir: dir, seed: 3 })
    const m = await compileShards({ modelDir: dir, outDir: `${dir}-shards`, stages: 2, opSet: 'standard' })
    const p = await openPipeline(`${dir}-shards`, m)
    const V = m.shape.vocabSize
    try {
      const a = [5, 6, 7, 8, 9, 10, 11]
      const b = [20, 21, 22]
      const all = await prefill(p, [a], 0)
      expect(all.kept).toBe(a.length)
      const last = await prefill(p, [a], 1)
      expect(last.kept).toBe(1)
      const tail = all.logits.subarray((a.length - 1) * V)
      last.logits.forEach((v, i) => expect(Math.abs(v - tail[i]!)).toBeLessThan(1e-4))
      // Batch of two, b left-padded by 4: each row's last logits equal its own unpadded run.
      const batch = await prefill(p, [a, b], 1)
      const alone = await prefill(p, [b], 1)
      for (let i = 0; i < V; i++) {
        expect(Math.abs(batch.logits[i]! - last.logits[i]!)).toBeLessThan(1e-4)
        expect(Math.abs(batch.logits[V + i]! - alone.logits[i]!)).toBeLessThan(1e-4)
      }
    } finally {
      await p.release()
    }
  })
})
