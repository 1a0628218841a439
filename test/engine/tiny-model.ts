/**
 * Test fixture: a tiny random-weight Llama checkpoint compiled to a 1-stage fp32 shard directory
 * in a temp dir, via the shards module (generateTestModel + compileShards).
 */
import { mkdtemp, rm } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { compileShards, generateTestModel } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'

export interface TinyModel {
  shardDir: string
  graphPath: string
  manifest: ShardManifest
  cleanup (): Promise<void>
}

export async function buildTinyModel (architecture: 'llama' | 'qwen2' | 'qwen3' | 'phi3' = 'llama', opSet?: 'standard' | 'ort-contrib', staticShapes?: { contextLength: number, chunk: number }): Promise<TinyModel> {
  const dir = await mkdtemp(join(tmpdir(), 'shoal-engine-'))
  await generateTestModel({ architecture, outDir: join(dir, 'ckpt'), size: 'tiny' })
  const shardDir = join(dir, 'shard')
  const manifest = await compileShards({ modelDir: join(dir, 'ckpt'), outDir: shardDir, modelId: `tiny-${architecture}`, ...(opSet === undefined ? {} : { opSet }), ...(staticShapes === undefined ? {} : { static: staticShapes }) })
  const stage = manifest.stages[0]!
  return {
    shardDir,
    graphPath: join(shardDir, ...stage.graph.split('/')),
    manifest,
    cleanup: () => rm(dir, { recursive: true, force: true }),
  }
}
