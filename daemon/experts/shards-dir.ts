/**
 * An expert-parallel shard directory (shards/expert-shards.ts) as the daemon opens it: its layout
 * and its key. The key is the sha256 of layout.json's bytes; the layout names the checkpoint's
 * content hash, so a stage and a holder agree on the key exactly when they hold the same
 * compilation of the same weights. /shoal/experts frames carry it and holders gossip it.
 */
import { createHash } from 'node:crypto'
import { existsSync } from 'node:fs'
import { readFile } from 'node:fs/promises'
import { join } from 'node:path'
import { EXPERT_SHARDS_FORMAT, type ExpertShardLayout } from '../../shards/index.ts'
import { ShoalError } from '../errors.ts'
import { expertBytes } from './dispatch.ts'

export const LAYOUT_FILE = 'layout.json'

export interface ExpertShards {
  dir: string
  layout: ExpertShardLayout
  /** sha256 (hex) of layout.json. */
  key: string
  /** Served model id (the layout's, else the directory's name). */
  modelId: string
  /** Resident bytes of one expert. */
  expertBytes: number
  /** Experts in the whole model (MoE layers × experts per layer). */
  experts: number
}

/** True for a directory that `compileExpertShards` wrote (it has a layout.json). */
export function isExpertShardDir (dir: string): boolean {
  return existsSync(join(dir, LAYOUT_FILE))
}

export async function openExpertShards (dir: string): Promise<ExpertShards> {
  const bytes = await readFile(join(dir, LAYOUT_FILE))
  let layout: ExpertShardLayout
  try {
    layout = JSON.parse(bytes.toString('utf8')) as ExpertShardLayout
  } catch (err) {
    throw new ShoalError('SHOAL_ERR_SHARD_INVALID', `${dir}/${LAYOUT_FILE} is not JSON: ${(err as Error).message}`)
  }
  if (layout.format !== EXPERT_SHARDS_FORMAT) throw new ShoalError('SHOAL_ERR_SHARD_INVALID', `${dir}: layout format ${String(layout.format)} is not ${EXPERT_SHARDS_FORMAT}`)
  const moe = layout.shape?.moe
  if (moe === undefined) throw new ShoalError('SHOAL_ERR_SHARD_INVALID', `${dir}: not a mixture-of-experts model`)
  return {
    dir,
    layout,
    key: createHash('sha256').update(bytes).digest('hex'),
    modelId: layout.modelId ?? dir.split('/').filter(Boolean).pop()!,
    expertBytes: expertBytes(layout.shape, layout.quantization),
    experts: moe.moeLayers.length * moe.numExperts,
  }
}
