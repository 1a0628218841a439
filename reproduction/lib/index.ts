/** What the benchmark scripts share: summaries, deterministic prompts, the machine's load line, shoal child daemons. */
export { floorRank, lowerMedian, median, nearestRank, upperMedian, upperMedianBy } from './stats.ts'
export { lcgTokens, promptIds, raggedPromptIds, streamPromptIds } from './prompts.ts'
export { formatLoad, loadAverage } from './machine.ts'
export { createShoalProcesses, SHOAL_BIN } from './processes.ts'
export type { ShoalProcesses } from './processes.ts'
