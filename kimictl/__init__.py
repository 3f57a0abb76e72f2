"""kimictl: deploy and operate Kimi K2.5 on Atlas 800 A2/A3 with vLLM-Ascend (P/D disaggregated)."""

__version__ = "0.1.0"
