/**
 * Reading an HF checkpoint directory: config, generation defaults, tokenizer files, and a
 * content hash over everything that affects the compiled shards.
 */
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { readFile } from 'node:fs/promises'
import { basename, join } from 'node:path'
import type { GenerationDefaults } from './contract.ts'
import { CheckpointError } from './errors.ts'
import { sha256File } from './manifest.ts'
import { checkpointWeightFiles } from './safetensors.ts'
import type { HfConfig } from './architectures.ts'

/** Tokenizer-side files copied into a shard directory when present. */
export const TOKENIZER_FILES = ['tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'generation_config.json']

export async function readJson<T = Record<string, unknown>> (file: string): Promise<T> {
  let text: string
  try {
    text = await readFile(file, 'utf8')
  } catch (err) {
    throw new CheckpointError(`${file}: cannot read`, { cause: err })
  }
  try {
    return JSON.parse(text) as T
  } catch (err) {
    throw new CheckpointError(`${file}: not valid JSON`, { cause: err })
  }
}

export async function readOptionalJson (file: string): Promise<Record<string, unknown> | undefined> {
  return existsSync(file) ? await readJson(file) : undefined
}

export async function readConfig (dir: string): Promise<HfConfig> {
  return await readJson(join(dir, 'config.json'))
}

function ids (v: unknown): number[] {
  if (typeof v === 'number') return [v]
  if (Array.isArray(v)) return v.filter((x): x is number => typeof x === 'number')
  return []
}

function tokenString (v: unknown): string | undefined {
  if (typeof v === 'string') return v
  if (v !== null && typeof v === 'object' && typeof (v as { content?: unknown }).content === 'string') return (v as { content: string }).content
  return undefined
}

/** eos/bos ids and BOS policy from generation_config.json, config.json and the tokenizer files. */
export async function readGenerationDefaults (dir: string, config: HfConfig): Promise<GenerationDefaults> {
  const gen = await readOptionalJson(join(dir, 'generation_config.json')) ?? {}
  const tokCfg = await readOptionalJson(join(dir, 'tokenizer_config.json')) ?? {}
  const tok = await readOptionalJson(join(dir, 'tokenizer.json'))
  const added = new Map<string, number>()
  for (const t of (tok?.added_tokens ?? []) as Array<{ id: number, content: string }>) added.set(t.content, t.id)
  const vocab = ((tok?.model as { vocab?: Record<string, number> } | undefined)?.vocab) ?? {}
  const idOf = (s: string | undefined): number | undefined => s === undefined ? undefined : added.get(s) ?? vocab[s]

  const eos = new Set<number>([...ids(gen.eos_token_id), ...ids(config.eos_token_id)])
  const eosTok = idOf(tokenString(tokCfg.eos_token))
  if (eosTok !== undefined) eos.add(eosTok)
  const bos = ids(gen.bos_token_id)[0] ?? ids(config.bos_token_id)[0] ?? idOf(tokenString(tokCfg.bos_token))
  const bosText = bos === undefined ? undefined : [...added].find(([, id]) => id === bos)?.[0]
  const post = JSON.stringify(tok?.post_processor ?? null)
  const tokenizerAddsBos = bosText !== undefined && /TemplateProcessing/.test(post) && post.includes(JSON.stringify(bosText))
  const addBosToken = typeof tokCfg.add_bos_token === 'boolean' ? tokCfg.add_bos_token : tokenizerAddsBos
  return {
    ...(bos !== undefined ? { bosTokenId: bos } : {}),
    eosTokenIds: [...eos].sort((a, b) => a - b),
    addBosToken,
    tokenizerAddsBos,
  }
}

/** sha256 over (name, sha256) of config, weights and tokenizer files: the checkpoint's identity. */
export async function checkpointHash (dir: string): Promise<string> {
  const files = ['config.json', ...TOKENIZER_FILES.filter(f => existsSync(join(dir, f)))]
  if (existsSync(join(dir, 'model.safetensors.index.json'))) files.push('model.safetensors.index.json')
  const weights = await checkpointWeightFiles(dir)
  const h = createHash('sha256')
  for (const f of [...files.map(f => join(dir, f)), ...weights].sort()) h.update(`${basename(f)}\0${await sha256File(f)}\n`)
  return h.digest('hex')
}
